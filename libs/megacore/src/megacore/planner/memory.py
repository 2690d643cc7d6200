"""The planner's memory model: what each rank of a layout holds during a training step, in bytes,
per rank (`estimate`) and at its fullest (`peak`, and `peak_bytes` for the searches, which size
the parameters once per layout). Activations are `megacore.planner.activations`'.

State (exact: tests/train/test_planner.py sums a live run's tensors on every rank):
- weights: the fp32 master parameters of the rank's stages (`model_tensors`), tp-local (and an
  experts tensor's experts / ep under expert parallel), then with FSDP2 (dp x cp > 1: parameters
  are replicated over cp as over dp, and FSDP2 shards them over both, flattened) dim 0 (an
  experts tensor's rows or columns: `layout.fsdp_dim`) cut in dp·cp chunks (an experts tensor's
  in edp·cp chunks under ep: FSDP2 shards the experts over edp x cp) of ceil(rows / (dp·cp)) rows, the
  last ones shorter or empty: what `to_local()` returns. FSDP2's storage pads every chunk to the first one's rows;
  the largest rank (replica 0), which decides whether a layout fits, holds exactly that.
- grads: fp32, the same shapes, except the vocab-parallel embedding's under tp without FSDP2:
  DTensor's backward leaves the whole table's gradient on every tp rank; DeepSeek V3's balancing
  bias has none (nor AdamW state: held as LoRA's frozen base is, `_kind`).
- optimizer: AdamW's exp_avg and exp_avg_sq (fp32, the parameters' shapes) and its step counter,
  a 4-byte tensor per parameter. copies: bf16/fp16 compute copies of every parameter
  (`engine.ComputeCopies`), held with mixed precision when dp x cp is 1, except under the
  zero-bubble schedules (FSDP2 on a one-rank mesh there: `dims.ZERO_BUBBLE`); the engine's
  wrapping rules are layout.py's `compute_copies` and `fsdp_wrapped`, the same functions the engine
  applies (given `Dims`).
- LoRA (`Parallelism.lora`, its `modules` resolved): the adapters (`parts.adapter_tensors`, placed
  by `layout.place`) are the trained parameters above; the frozen base has weights alone, fp32 (as
  FSDP2 shards it, casting what it gathers) or, with compute copies, in the compute dtype alone;
  QLoRA's projections in NF4 (`config.nf4_bytes`, plus each tensor's scales' mean and code table).
  FSDP2 gathers NF4 as its codes and reduces the adapters' gradients alone.

Buffers (transient or bookkeeping, counted at once, so an upper bound; T, h, c as in
`megacore.planner.activations`):
- a pipeline stage's receive buffers, preallocated for every microbatch (activations in, gradients
  back: T·h·c each; a stage's first block reads its input from one);
- context parallel: one layer's k and v gradients of the whole sequence before their reduce-scatter;
- expert parallel: a layer's routed rows (T·k·h·c) as sent and as received by an all-to-all;
- linear attention (Qwen 3.5): the delta rule's intermediates while one layer's backward
  recomputes it (`parts.linear.recompute_bytes`);
- FSDP2's unsharded parameters in the compute dtype (the root's embedding, norm and head plus two
  blocks with prefetch; with a pipeline all of the stage, not resharded between microbatches; fp8
  with tensorwise scaling gathers the blocks' projections in float8, a byte each), one
  block's gradient reduction (compute dtype + fp32), and with several microbatches the stage's
  unsharded fp32 gradients: gradient sync is off for all but the last microbatch, and FSDP2 then
  accumulates unsharded;
- without dp, the largest parameter's compute-dtype gradient; the loss's scratch (fused) or its
  fp32 logits copies.
Measured on CPU (a 4-layer, hidden-256 Llama, 2 processes): one process never over the peak and
at most 5% under it in fp32, 10% in bf16 (activations alone; the test's bounds 15% and 25%,
tests/train/test_planner.py); with tp, pp or dp activations + buffers within 20% of the peak of a
step, except sequence parallel with accumulation (30% under: DTensor collectives' transients);
cp 2 (planner_worker.py, a hidden-256 Llama at S 256): activations 1% under to 9% over the tensors
autograd saves (the test's bounds 3% and 10%), activations + buffers 2-24% over the peak (which
varies from run to run with gloo's all-gathers). ALLOWANCE, a fixed 4 GiB per GPU, covers what is not modelled:
the CUDA context and kernels, NCCL buffers, allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache, partial

from megacore.config import (
    LOSS_CHUNK_ELEMENTS,
    ModelConfig,
    is_adapter_tensor,
    is_block_projection,
    nf4_bytes,
)
from megacore.parallel.build_rules import (
    compute_copies,
    float8_all_gather,
    float8_weight,
    fsdp_wrapped,
    fused_loss,
)
from megacore.parallel.dims import Dims, Parallelism
from megacore.parallel.layout import (
    TensorPlace,
    check_parallelism,
    fsdp_dim,
    fsdp_unit,
    is_experts,
    place,
    tp_box,
)
from megacore.parts import adapter_tensors, attention_part, linear, model_tensors
from megacore.parts.attention import kv_width
from megacore.planner.activations import (
    COMPUTE_BYTES,
    compute,
    in_flight,
    rank_activations,
    sequence_shards,
)

GiB = 1 << 30
NF4_TABLE = 17  # an NF4 tensor's scales' mean and its 16 codes' values, in its dtype (fp32 here)
ALLOWANCE = 4 * GiB  # per GPU, for what the model leaves out (module docstring)

Tensors = list[tuple[str, tuple[int, ...]]]  # a rank's parameters: names and local shapes
Placer = Callable[[str, int], TensorPlace]  # `layout.place` of a name at a tp size, for one config


def _dp_sharded(par: Parallelism, dims: Dims) -> bool:
    return dims.replicas > 1 and par.spec.dp_mode == "fsdp"


# --- state ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """A rank's persistent tensors, bytes."""

    weights: int
    grads: int
    optimizer: int
    copies: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.copies


def rank_tensors(
    config: ModelConfig, par: Parallelism, pp_rank: int, placer: Placer | None = None
) -> Tensors:
    """Names and local shapes of the parameters of a pipeline rank's stages: tp-local, and an
    experts tensor's experts / ep under expert parallel. Every tp and ep rank holds the same
    shapes: the splits are even (`check_tp`, `check_ep`) or the tensor is replicated. `placer`:
    `layout.place` of this config (a search's remembers each name's)."""
    placer = placer or partial(_place, config)
    layers = check_parallelism(config, par)
    tp, ep, last = par.spec.tp, par.spec.ep, len(layers) - 1
    out = []
    for s in par.rank_stages(pp_rank):
        tensors = model_tensors(config, layers[s], embed=s == 0, head=s == last)
        if par.lora is not None:  # the stage's adapters (`LoRA.modules`: every layer's)
            mine = {f"layers.{i}." for i in layers[s]}
            modules = [m for m in par.lora.modules if m[: m.index(".", 7) + 1] in mine]
            tensors |= adapter_tensors(config, modules, par.lora.rank)
        for name, shape in tensors.items():
            local = tp_box(placer(name, tp), shape, tp, 0)[1]
            out.append((name, (local[0] // ep, *local[1:]) if is_experts(name) else local))
    return out


def _kind(name: str, par: Parallelism) -> str:
    """How a parameter is held: "trained" (fp32 master, gradient, AdamW moments), or LoRA's frozen
    base, "frozen" (its weights alone) or "nf4" (QLoRA's projections, `config.nf4_bytes`). DeepSeek
    V3's balancing bias is frozen too: a parameter without a gradient, which the engine moves and no
    optimizer holds (`ComputeCopies` keeps it in the compute dtype alone, as LoRA's base)."""
    if name.endswith(".mlp.router_bias"):
        return "frozen"
    if par.lora is None or is_adapter_tensor(name):
        return "trained"
    return "nf4" if par.lora.base_dtype == "nf4" and is_block_projection(name) else "frozen"


def _dp_local(shape: tuple[int, ...], dim: int, shards: int, index: int) -> int:
    """Elements of a local tensor on shard `index` of `shards` under FSDP2: its dim `dim` in
    torch.chunk blocks (`chunk_split`), computed for one rank."""
    rows = shape[dim]
    size = -(-rows // shards)
    return max(0, min(size, rows - index * size)) * math.prod(shape) // rows


def _place(config: ModelConfig, name: str, tp: int) -> TensorPlace:
    return place(name, config, tp)


def _shard_groups(
    config: ModelConfig, par: Parallelism, tensors: Tensors, placer: Placer | None = None
) -> Counter:
    """A rank's tensors counted by (shape, FSDP2's dim (`layout.fsdp_dim`), whether experts): what
    its state bytes depend on, the same on every dp rank."""
    tp, placer = par.spec.tp, placer or partial(_place, config)
    return Counter(
        (
            shape,
            fsdp_dim(name, shape, placer(name, tp).tp_dim if tp > 1 else None),
            is_experts(name),
            _kind(name, par),
        )
        for name, shape in tensors
    )


def _state(
    config: ModelConfig,
    par: Parallelism,
    dims: Dims,
    replica: int,
    tensors: Tensors,
    shards: Counter | None = None,
) -> State:
    """`shards`: `_shard_groups` of `tensors`, worked out once for every replica of a pipeline rank."""
    tp = dims.tp
    shards = shards if shards is not None else _shard_groups(config, par, tensors)
    c = COMPUTE_BYTES[par.precision]
    copies = compute_copies(par, dims)
    numel = Counter()  # local elements by kind
    frozen_bytes = 0
    trained_tensors = 0
    for (s, d, e, kind), n in shards.items():
        # Under ep the experts are sharded over edp x cp (the mesh's dp is edp x ep, ep inner).
        if not _dp_sharded(par, dims):
            local = math.prod(s)
        elif e:
            local = _dp_local(s, d, dims.experts_replicas, dims.experts_replica(replica))
        else:
            local = _dp_local(s, d, dims.replicas, replica)
        numel[kind] += n * local
        if kind == "nf4":  # codes, scales and factors, plus its scales' mean and code table
            frozen_bytes += n * (nf4_bytes(local, math.prod(s)) + NF4_TABLE * 4)
        trained_tensors += n if kind == "trained" else 0
    # A frozen base (LoRA) is held in the compute dtype alone where the engine keeps compute copies,
    # else as the parameters are (fp32: FSDP2 casts what it gathers).
    frozen_bytes += numel["frozen"] * (c if copies else 4)
    trained = numel["trained"]
    grads = trained
    if (
        tp > 1
        and par.lora is None
        and not fsdp_wrapped(par, dims)
        and any(n == "embed.weight" for n, _ in tensors)
        and not (config.tie_embeddings and any(n == "norm.weight" for n, _ in tensors))
    ):
        # The vocab-parallel embedding's gradient comes out of DTensor's backward replicated: the
        # whole table on every tp rank (FSDP2 reduces it to the parameter's shard; tied on the
        # stage with the head, the head's sharded gradient is added to it). Tied under pp, the
        # engine shards it once the backward is over, to sum it with the last stage's copy: it is
        # whole until then, through the step's peak, so it is counted whole.
        grads += config.padded_vocab_size * config.hidden_size * (tp - 1) // tp
    return State(
        weights=4 * trained + frozen_bytes,
        grads=4 * grads,
        optimizer=8 * trained + 4 * trained_tensors,
        copies=c * trained if copies else 0,
    )


def rank_state(config: ModelConfig, par: Parallelism, dp: int, pp_rank: int = 0, replica: int = 0) -> State:
    """The bytes of weights, gradients, AdamW state and compute copies on a rank (any tp rank) of a
    job with `dp` data-parallel ranks. `replica`: the rank's place in FSDP2's mesh (`Dims.replica`)."""
    return _state(config, par, par.dims(dp), replica, rank_tensors(config, par, pp_rank))


# --- buffers -------------------------------------------------------------------------------------


def rank_buffers(config: ModelConfig, par: Parallelism, dp: int, pp_rank: int, micro: int, seq: int) -> int:
    """Transient and bookkeeping bytes on a rank, all counted at once (module docstring)."""
    tensors = rank_tensors(config, par, pp_rank)
    return _param_buffers(config, par, par.dims(dp), tensors) + _token_buffers(
        config, par, pp_rank, micro, seq
    )


def _param_buffers(config: ModelConfig, par: Parallelism, dims: Dims, tensors: Tensors) -> int:
    """The buffers the parameters size: FSDP2's, or a compute-dtype gradient without it (a trained
    parameter's: LoRA's frozen base gets none)."""
    c = COMPUTE_BYTES[par.precision]
    if fsdp_wrapped(par, dims):
        return _fsdp_buffers(par, dims, tensors, c)
    if compute_copies(par, dims):
        return max(math.prod(shape) for name, shape in tensors if _kind(name, par) == "trained") * c
    return 0


def _fsdp_buffers(par: Parallelism, dims: Dims, tensors: Tensors, c: int) -> int:
    """FSDP2's buffers: the unsharded parameters, a reduction's gradients and, with several
    microbatches, the unsharded gradients. FSDP2's units are the engine's (`layout.fsdp_unit`):
    the stage's root (embedding, final norm, head) and each block, its experts apart under ep,
    gathered with their block. Gathered in the compute dtype, float8 weights in 1 byte (fp8 with
    tensorwise scaling), QLoRA's NF4 weights as their codes (each then dequantized for its matmul);
    LoRA's frozen base has no gradients to reduce."""
    gathered, trained = Counter(), Counter()  # bytes gathered, trained elements, by unit ("": the root)
    gathers8, largest_nf4 = float8_all_gather(par, dims), 0
    for name, shape in tensors:
        size, kind = math.prod(shape), _kind(name, par)
        key = ".".join(fsdp_unit(name, dims).split(".")[:2])  # "layers.<i>": a block and its experts
        if kind == "nf4":
            gathered[key] += nf4_bytes(size)
            largest_nf4 = max(largest_nf4, size)
        else:  # (float8 by the rank's shapes: tp's pieces)
            gathered[key] += size * (1 if gathers8 and float8_weight(name, shape) else c)
        trained[key] += size if kind == "trained" else 0
    root, root_trained = gathered.pop("", 0), trained.pop("", 0)
    single = par.spec.pp * par.stages_per_rank == 1
    # Two blocks with prefetch; with a pipeline all of the stage, not resharded between microbatches.
    unsharded = root + 2 * max(gathered.values(), default=0) if single else root + sum(gathered.values())
    # A reduction's gradients in the compute dtype and in fp32.
    total = unsharded + largest_nf4 * c + max(root_trained, max(trained.values(), default=0)) * (c + 4)
    if par.microbatches > 1:
        # Gradient sync is off for every microbatch but the last (`ParallelModel._grad_sync`, the
        # pipeline stage's no-sync backward): FSDP2 then accumulates unsharded fp32 gradients.
        total += (root_trained + sum(trained.values())) * 4
    return total


def _token_buffers(config: ModelConfig, par: Parallelism, pp_rank: int, micro: int, seq: int) -> int:
    """The buffers the tokens size: a pipeline's receive buffers, cp's gradients, ep's all-to-all
    buffers, linear attention's recomputed delta rule (one layer's at a time), the loss's."""
    num_stages, stages = par.spec.pp * par.stages_per_rank, par.rank_stages(pp_rank)
    c, tp, cp = COMPUTE_BYTES[par.precision], par.spec.tp, par.spec.cp
    tokens = micro * seq // cp
    residual = math.ceil(tokens / sequence_shards(par)) * config.hidden_size * c
    total = 0
    if num_stages > 1:  # torch's PipelineStage allocates its receive buffers for every microbatch
        for s in stages:
            total += ((s > 0) + (s < num_stages - 1)) * par.microbatches * residual
    if cp > 1:  # a layer's gathered k and v gradients, the whole sequence's, before the reduce-scatter
        total += 2 * micro * seq * kv_width(config, tp) * c
    if par.spec.ep > 1:  # a layer's routed rows as sent and as received, in each all-to-all
        total += 2 * tokens * config.moe.experts_per_token * config.hidden_size * c
    if config.linear_attention is not None:
        total += linear.recompute_bytes(config, compute(par), micro, seq // cp)
    if num_stages - 1 in stages:
        vocab = config.padded_vocab_size
        if fused_loss(par):
            chunk = max(1, min(tokens, LOSS_CHUNK_ELEMENTS // vocab))
            total += chunk * vocab * 4
            if c < 4:
                total += chunk * vocab * c + (vocab * config.hidden_size * 4 if tokens > chunk else 0)
        else:
            local = tokens * (vocab // tp)
            padded = vocab > config.vocab_size
            # logits (unless the pipeline keeps them), their fp32 copy, the copy with padding masked
            total += local * ((0 if num_stages > 1 else c) + (4 if c < 4 else 0) + (4 if padded else 0))
    return total


@dataclass(frozen=True)
class RankTensors:
    """A pipeline rank's tensors (`rank_tensors`) and their `_shard_groups`, what its state bytes are
    counted from in any layout of the same tp x pp x ep."""

    tensors: Tensors
    shards: Counter


def fixed_bytes(config: ModelConfig, par: Parallelism, dp: int, ranks: list[RankTensors]) -> list[int]:
    """Per pipeline rank, what neither the sequence nor recompute changes: replica 0's state (FSDP2's
    first chunks are the longest) and the parameters' buffers."""
    dims = par.dims(dp)
    return [
        _state(config, par, dims, 0, r.tensors, r.shards).total + _param_buffers(config, par, dims, r.tensors)
        for r in ranks
    ]


def rollout_cache(config: ModelConfig, par: Parallelism, pp_rank: int, rows: int, positions: int) -> int:
    """The KV cache a pipeline rank holds while the sampler (`parallel.sampler`) completes `rows`
    rows of up to `positions` positions (prompt and completion): its stages' layers', each its
    attention part's (`cache_bytes`: k and v of the rank's kv heads, latent attention's latent, or
    linear attention's convolution inputs and state), in the compute dtype, allocated whole when
    the prompts' forward starts (`models.kv_cache`)."""
    layers = check_parallelism(config, par)
    c, tp = COMPUTE_BYTES[par.precision], par.spec.tp
    return sum(
        attention_part(config, i).cache_bytes(config, tp, rows, positions, c)
        for s in par.rank_stages(pp_rank)
        for i in layers[s]
    )


def peak_bytes(
    config: ModelConfig, par: Parallelism, fixed: list[int], micro: int, seq: int, attention: str
) -> int:
    """The fullest rank's bytes, as `peak(estimate(..., all_dp_ranks=False))`, from `fixed_bytes`."""
    return max(
        b
        + rank_activations(config, par, r, micro, seq, attention)
        + _token_buffers(config, par, r, micro, seq)
        for r, b in enumerate(fixed)
    )


TensorCache = Callable[[Parallelism], list[RankTensors]]


def tensor_cache(config: ModelConfig) -> TensorCache:
    """Each pipeline rank's tensors and shard groups by tp x pp x ep, for a search of many layouts
    of one base (its LoRA): they do not depend on cp, dp, recompute or the microbatches (the caller
    checks those: `check_parallelism`)."""
    by_layout: dict[tuple[int, int, int], list[RankTensors]] = {}
    placer = cache(partial(_place, config))  # the same names at every pp and ep

    def tensors(par: Parallelism) -> list[RankTensors]:
        key = (par.spec.tp, par.spec.pp, par.spec.ep)
        if key not in by_layout:
            ranks = (rank_tensors(config, par, r, placer) for r in range(par.spec.pp))
            by_layout[key] = [RankTensors(t, _shard_groups(config, par, t, placer)) for t in ranks]
        return by_layout[key]

    return tensors


# --- per rank ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory(State):
    """One rank's bytes (or several ranks' with the same numbers: `ranks`): its `State` and what a
    step adds to it."""

    ranks: tuple[int, ...]
    pp_rank: int
    activations: int
    buffers: int
    in_flight: int

    @property
    def state(self) -> int:
        return super().total

    @property
    def total(self) -> int:
        return self.state + self.activations + self.buffers


def estimate(
    config: ModelConfig,
    par: Parallelism,
    dp: int,
    micro: int,
    seq: int,
    attention: str = "sdpa",
    all_dp_ranks: bool = True,
) -> list[RankMemory]:
    """Every rank of the layout, in rank order, ranks with the same numbers merged: a row per
    pipeline rank, more when FSDP2's chunks differ over the replicas. `all_dp_ranks=False` computes
    replica 0 only (the fullest: FSDP2's first chunks are the longest), for the peak."""
    check_parallelism(config, par)
    dims = par.dims(dp)
    rows: list[RankMemory] = []
    for pp_rank in range(dims.pp):
        tensors = rank_tensors(config, par, pp_rank)
        activations = rank_activations(config, par, pp_rank, micro, seq, attention)
        buffers = _param_buffers(config, par, dims, tensors) + _token_buffers(
            config, par, pp_rank, micro, seq
        )
        by_state: dict[State, list[int]] = {}
        shards = _shard_groups(config, par, tensors)
        for replica in range(dims.replicas if _dp_sharded(par, dims) and all_dp_ranks else 1):
            by_state.setdefault(_state(config, par, dims, replica, tensors, shards), []).append(replica)
        if not _dp_sharded(par, dims):  # whole parameters on every dp (and cp) rank
            by_state = {st: list(range(dims.replicas)) for st in by_state}
        for st, replicas in by_state.items():
            ranks = tuple(dims.rank(pp_rank, r, t) for r in replicas for t in range(dims.tp))
            rows.append(
                RankMemory(
                    ranks=ranks,
                    pp_rank=pp_rank,
                    **dataclasses.asdict(st),
                    activations=activations,
                    buffers=buffers,
                    in_flight=in_flight(par, pp_rank),
                )
            )
    return sorted(rows, key=lambda r: r.ranks[0])


def peak(rows: Iterable[RankMemory]) -> int:
    """The largest rank's bytes."""
    return max(r.total for r in rows)
