"""The memory planner: what each rank of a layout holds during a training step, the tp/pp/cp/dp
layouts of N GPUs that fit their memory, ranked by a simple throughput model, and the longest
sequence each layout fits (docs/architecture.md).

Torch-free, like `layout` (mega-train's dry run uses it without torch). It models this engine:
the `Decoder`'s ops, `ParallelModel`'s wrapping and torch's pipeline schedules, not transformers in
general. Sizes are bytes; S = sequence length, T = micro batch x S / cp tokens per microbatch (a
context-parallel rank holds S / cp tokens of each row, `cp.py`), c = bytes of the compute dtype
(4 fp32, 2 bf16/fp16), "tp-local" = the part `place`/`tp_box` give a tp rank, kv = the tp-local
width of k (kv heads x head_dim; one head where tp replicates them).

State (exact: tests/train/test_planner.py sums a live run's tensors on every rank):
- weights: the fp32 master parameters of the rank's stages (`model_tensors`), tp-local (and an
  experts tensor's experts / ep under expert parallel), then with FSDP2 (dp x cp > 1: parameters
  are replicated over cp as over dp, and FSDP2 shards them over both, flattened) dim 0 (an
  experts tensor's rows or columns: `layout.fsdp_dim`) cut in dp·cp chunks (an experts tensor's
  in dp/ep chunks under ep: FSDP2 shards the experts over edp) of ceil(rows / (dp·cp)) rows, the
  last ones shorter or empty: what `to_local()` returns. FSDP2's storage pads every chunk to the first one's rows;
  the largest rank (dp rank 0), which decides whether a layout fits, holds exactly that.
- grads: fp32, the same shapes, except the vocab-parallel embedding's under tp without FSDP2:
  DTensor's backward leaves the whole table's gradient on every tp rank.
- optimizer: AdamW's exp_avg and exp_avg_sq (fp32, the parameters' shapes) and its step counter,
  a 4-byte tensor per parameter. copies: bf16/fp16 compute copies of every parameter
  (`engine.ComputeCopies`), held with mixed precision when dp x cp is 1, except under the
  zero-bubble schedules (FSDP2 on a one-rank mesh there: `layout.ZERO_BUBBLE`); the engine's
  wrapping rules are layout.py's `compute_copies` and `fsdp_wrapped`, the same functions the engine
  applies (given dp x cp).

Activations (what autograd saves, op by op; the test measures a step on CPU):
- per layer and microbatch, recompute none: the inputs of the norms (T·h·c each, /tp with sequence
  parallel, plus their fp32 statistics), the norm outputs the projections read (T·h·c), rotated q
  and k, v (with the fused q/k/v matmul at tp 1, v is a view of the whole projection output, which
  stays alive: T·(q+2kv)·c), the attention output and the o_proj input (a copy of it), the
  log-sum-exp (fp32), the MLP's gate, up, silu and product (4·T·f/tp·c; GELU: 2), and at tp 1 the
  concatenated q/k/v and gate/up weights the fused matmuls save (GeGLU as SwiGLU); per-head q/k
  norms (qk_norm) their fp32 statistics, and at tp > 1 their inputs; sandwich norms (Gemma) the
  attention's and the MLP's outputs they normalise, and their statistics. Gemma's (1 + w) RMSNorm
  saves what the fused RMSNorm does; where it runs as plain ops (on a sequence shard, a q/k norm
  at tp > 1) its fp32 input and fp32 normalised input. A sliding window shorter than the sequence
  adds the S x S mask SDPA saves (not with flash-attn), on the layers that slide
  (`attention_window`). selective: without the attention kernel's output and log-sum-exp (its
  kernels keep no S x S matrix to drop). full: the block's input only, plus one layer's recompute at
  the peak of the backward.
- context parallel (cp > 1): all of the above for the rank's T tokens; attention adds the whole
  sequence's k and v, all-gathered per layer (2·micro·S·kv·c, SDPA keeping slices of them) and,
  with a window shorter than a chunk's keys (not with flash-attn), that chunk's mask against the
  keys up to its end (S/2cp x end), on the fullest rank, instead of the S x S one (on a CPU a late
  chunk without a window materialises one too: not counted; on a GPU none).
  Selective recompute drops both (the cp kernel reruns whole, its all-gather included).
- per stage: token ids (first), the RoPE tables (twice with Gemma 3's local ones; cos and sin
  [S, hd], under cp per row: [micro, S / cp, hd], as cp gives positions), the final norm and the
  loss (last: the fused loss saves the hidden-state and weight gradients; vocab-parallel logits
  keep their fp32 log-softmax, and a pipeline's last stage keeps its logits too), a pipeline
  stage's output (kept until its backward).
- in flight (`in_flight`): microbatch-chunks a pipeline rank holds at its peak, from the schedules'
  own warmup counts: 1 without a pipeline (gradient accumulation runs microbatches one by one);
  GPipe all m of them; 1F1B min(m, pp - rank), so pp on the first stage; interleaved 1F1B
  min(m·v, (v-1)·r + 2·(pp-1-rank) + 1) chunks of one local stage, r = m / max(1, m // pp)
  microbatches per round (interleaved zero bubble: 1 instead of 2 per hop, its deferred weight
  gradients not counted); ZB-V min(2m, 2·pp).
Buffers (transient or bookkeeping, counted at once, so an upper bound):
- a pipeline stage's receive buffers, preallocated for every microbatch (activations in, gradients
  back: T·h·c each; a stage's first block reads its input from one);
- context parallel: one layer's k and v gradients of the whole sequence before their reduce-scatter;
- expert parallel: a layer's routed rows (T·k·h·c) as sent and as received by an all-to-all;
- FSDP2's unsharded parameters in the compute dtype (the root's embedding, norm and head plus two
  blocks with prefetch; with a pipeline all of the stage, not resharded between microbatches; fp8
  with tensorwise scaling gathers the blocks' projections in float8, a byte each), one
  block's gradient reduction (compute dtype + fp32), and with several microbatches the stage's
  unsharded fp32 gradients: gradient sync is off for all but the last microbatch, and FSDP2 then
  accumulates unsharded;
- without dp, the largest parameter's compute-dtype gradient; the loss's scratch (fused) or its
  fp32 logits copies.
Measured on CPU (a 4-layer, hidden-256 Llama, 2 processes): one process within 8% below the peak
(activations alone, the test's bound is 25%); with tp, pp or dp activations + buffers within 20%
of the peak of a step, except sequence parallel with accumulation (30% under: DTensor collectives'
transients); cp 2 (planner_worker.py, a hidden-256 Llama at S 256): activations within 5% of the
tensors autograd saves, activations + buffers 5-24% over the peak (which varies by some 6% from run
to run with gloo's all-gathers). ALLOWANCE, a fixed 4 GiB per GPU, covers what is not modelled:
the CUDA context and kernels, NCCL buffers, allocator fragmentation.

Ranking (`relative_throughput`, a deliberately simple model, not a measurement): the product of
- tensor parallel: 1 - 0.05·log2(tp) within a node (its all-reduces sit on the critical path),
  halved when the tp group spans nodes;
- the pipeline bubble: 1 - (pp-1)/(v·m + pp-1) (a third of that bubble for the zero-bubble
  schedules);
- recompute: forward and backward cost 3 forwards, full recompute adds a fourth (3/4); selective
  1/(1 + attention-core forward FLOPs / step FLOPs (`flops_per_token`));
- context parallel: 1 / (1 + r), r = a layer's k/v collectives' time over its compute time on a
  rank, for an H100-class GPU (400 TFLOP/s achieved; 400 GB/s within a node, 50 GB/s when the cp
  group spans nodes; 20 µs a collective): k and v all-gathered in the forward (again when
  recomputed) and reduce-scattered in the backward, none overlapped, each moving (cp-1)·T·kv·c;
  the compute T·`flops_per_token`/(layers·tp). Short sequences pay the latency, long ones little;
- expert parallel: 1 / (1 + r) likewise, r = a layer's all-to-alls' time over its compute: the
  routed rows sent to their experts and back in the forward, their gradients in the backward (and
  the forward's again with full recompute), each moving (ep-1)/ep·T·k·h·c, within a node while
  tp·cp·ep fits one. Every ep dividing dp and the experts is a candidate;
- data parallel: 0.97 for dp x cp > 1 (FSDP2's gathers and reductions, mostly overlapped).
Every candidate keeps the run's micro batch, global batch, precision, schedule (pipelines) and
sequence parallel; per layout the least recompute that fits is chosen. A cp > 1 layout is listed
only where it beats the same tp x pp with its cp ranks as dp ones (the same state sharding): it fits
where that one does not, or runs faster (say, more microbatches for a pipeline's bubble).

The longest sequence (`longest_sequence`, `longest_sequences`): per layout and recompute, the
longest seq_length, a multiple of 2·cp (and of cp·tp with sequence parallel: `check_cp`), whose
fullest rank fits; every term above grows with S, so a bisection finds it (up to MAX_SEQ).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from megacore.config import (
    GATED_ACTIVATIONS,
    LOSS_CHUNK_ELEMENTS,
    ModelConfig,
    attention_window,
    flops_per_token,
    local_rope,
    model_tensors,
)
from megacore.errors import UserError
from megacore.parallel.layout import (
    RECOMPUTE,
    ZERO_BUBBLE,
    Parallelism,
    check_cp,
    check_parallelism,
    compute_copies,
    float8_all_gather,
    float8_weight,
    fsdp_dim,
    fsdp_wrapped,
    is_experts,
    kv_replicated,
    place,
    tp_box,
)

GiB = 1 << 30
ALLOWANCE = 4 * GiB  # per GPU, for what the model leaves out (module docstring)
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 but the float8 matmuls
GPUS_PER_NODE = 8
TP_COST = 0.05  # throughput lost per doubling of tp within a node
DP_EFFICIENCY = 0.97


def _replicas(par: Parallelism, dp: int) -> int:
    """The ranks holding the same parameters, what FSDP2 shards over: dp x cp (`ParallelModel`)."""
    return dp * par.spec.cp


def _dp_sharded(par: Parallelism, dp: int) -> bool:
    return _replicas(par, dp) > 1 and par.spec.dp_mode == "fsdp"


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


def _rank_tensors(config: ModelConfig, par: Parallelism, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and local shapes of the parameters of a pipeline rank's stages: tp-local, and an
    experts tensor's experts / ep under expert parallel. Every tp and ep rank holds the same
    shapes: the splits are even (`check_tp`, `check_ep`) or the tensor is replicated."""
    layers = check_parallelism(config, par)
    tp, ep, last = par.spec.tp, par.spec.ep, len(layers) - 1
    out = []
    for s in par.rank_stages(pp_rank):
        for name, shape in model_tensors(config, layers[s], embed=s == 0, head=s == last).items():
            local = tp_box(place(name, config, tp), shape, tp, 0)[1]
            out.append((name, (local[0] // ep, *local[1:]) if is_experts(name) else local))
    return out


def _dp_local(shape: tuple[int, ...], dim: int, dp: int, dp_rank: int) -> int:
    """Elements of a local tensor on dp rank `dp_rank` under FSDP2: its dim `dim` in torch.chunk
    blocks (`chunk_split`), computed for one rank."""
    rows = shape[dim]
    size = -(-rows // dp)
    return max(0, min(size, rows - dp_rank * size)) * math.prod(shape) // rows


def _shard_groups(
    config: ModelConfig, par: Parallelism, tensors: list[tuple[str, tuple[int, ...]]]
) -> Counter:
    """A rank's tensors counted by (shape, FSDP2's dim (`layout.fsdp_dim`), whether experts): what
    its state bytes depend on, the same on every dp rank."""
    tp = par.spec.tp
    return Counter(
        (shape, fsdp_dim(shape, place(name, config, tp).tp_dim if tp > 1 else None), is_experts(name))
        for name, shape in tensors
    )


def _state(
    config: ModelConfig,
    par: Parallelism,
    dp: int,
    dp_rank: int,
    tensors: list[tuple[str, tuple[int, ...]]],
    shards: Counter | None = None,
) -> State:
    """`shards`: `_shard_groups` of `tensors`, worked out once for every dp rank of a pipeline rank."""
    tp, ep = par.spec.tp, par.spec.ep
    sharded, replicas = _dp_sharded(par, dp), _replicas(par, dp)
    shards = shards if shards is not None else _shard_groups(config, par, tensors)
    # Under ep the experts are sharded over edp (dp / ep), whose rank is the flattened dp index's
    # quotient (the mesh's dp is edp x ep, ep inner).
    numel = sum(
        n * (_dp_local(s, d, replicas // ep, dp_rank // ep) if e else _dp_local(s, d, replicas, dp_rank))
        if sharded
        else n * math.prod(s)
        for (s, d, e), n in shards.items()
    )
    grads = numel
    if (
        tp > 1
        and not fsdp_wrapped(par, replicas)
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
        weights=4 * numel,
        grads=4 * grads,
        optimizer=8 * numel + 4 * len(tensors),
        copies=COMPUTE_BYTES[par.precision] * numel if compute_copies(par, replicas) else 0,
    )


def rank_state(config: ModelConfig, par: Parallelism, dp: int, pp_rank: int = 0, dp_rank: int = 0) -> State:
    """The bytes of weights, gradients, AdamW state and compute copies on a rank (any tp rank).
    `dp_rank`: the rank's place in FSDP2's mesh, dp rank x cp + cp rank (dp x cp flattened)."""
    return _state(config, par, dp, dp_rank, _rank_tensors(config, par, pp_rank))


# --- activations ---------------------------------------------------------------------------------


def _seq_shard(par: Parallelism) -> int:
    return par.spec.tp if par.spec.sequence_parallel and par.spec.tp > 1 else 1


def _norm_stat(config: ModelConfig) -> int:
    """Bytes per token of a norm's fp32 statistics: RMSNorm's rstd; LayerNorm's mean and rstd."""
    return 8 if config.norm == "layernorm" else 4


def _plain_norm_extra(config: ModelConfig, saved: int, c: int) -> int:
    """Bytes a norm running as plain ops (on a sequence shard) saves beyond its input of `saved`
    bytes: nn.RMSNorm its normalised input (measured); Gemma's (1 + w) RMSNorm its fp32 normalised
    input and, in a 2-byte dtype, an fp32 copy of the input in the input's place."""
    if config.norm == "rmsnorm":
        return saved
    if config.norm == "rmsnorm_plus1":
        return saved * 4 // c + saved * (4 - c) // c
    return 0


def _kv_width(config: ModelConfig, tp: int) -> int:
    """The width of a tp rank's k (and v) after the projection: its kv heads x head_dim, one head
    where they are replicated (fewer kv heads than tp)."""
    if tp == 1:
        return config.num_kv_heads * config.head_dim
    return config.head_dim * (1 if kv_replicated(config, tp) else config.num_kv_heads // tp)


def _cp_attention(
    config: ModelConfig, par: Parallelism, micro: int, seq: int, kv: int, layer: int, attention: str
) -> int:
    """What context parallel's attention saves beyond a sequence of seq / cp (`cp.py`): the whole
    sequence's k and v (`kv` wide, tp-local), gathered once per layer, which SDPA keeps slices of;
    with a window shorter than a chunk's keys, that chunk's mask of its n = seq / 2cp queries against
    the keys up to its end, converted to an additive one in the compute dtype as SDPA saves it
    (none with flash-attn). Rank r's chunks r and 2cp-1-r end at (r+1)·n and (2cp-r)·n; the fullest
    rank counts."""
    cp, c = par.spec.cp, COMPUTE_BYTES[par.precision]
    gathered = 2 * micro * seq * kv * c
    window, n = attention_window(config, layer), seq // (2 * cp)
    if window is None or attention == "flash":
        return gathered
    ends = [((r + 1) * n, (2 * cp - r) * n) for r in range(cp)]
    return gathered + max(sum(n * end * c for end in pair if end > window) for pair in ends)


def _moe_activations(config: ModelConfig, tokens: int, c: int, tp: int) -> int:
    """What a mixture-of-experts MLP saves (models/moe.py): each routed (token, expert) row's input,
    gate, up, silu and product (tp-local: each expert's ffn is split over tp), and its output
    before the routing weight; the router's logits and fp32 probabilities, and the int64 indices
    and fp32 weights of the top-k choices."""
    routed, experts = tokens * config.experts_per_token, config.num_experts
    h, f = config.hidden_size, config.ffn_hidden_size // tp
    return routed * (4 * f + 2 * h) * c + tokens * experts * (c + 4) + routed * (2 * 8 + 2 * 4)


def layer_activations(
    config: ModelConfig,
    par: Parallelism,
    micro: int,
    seq: int,
    recompute: str | None = None,
    attention: str = "sdpa",
    layer: int = 0,
) -> int:
    """Bytes transformer layer `layer` saves for backward for one microbatch (module docstring)."""
    mode = par.recompute if recompute is None else recompute
    tp, c, cp = par.spec.tp, COMPUTE_BYTES[par.precision], par.spec.cp
    local = seq // cp  # the rank's tokens of each row: context parallel's part
    tokens, sp = micro * local, _seq_shard(par)
    h, hd = config.hidden_size, config.head_dim
    residual = math.ceil(tokens / sp) * h * c  # a hidden state on the residual stream
    if mode == "full":
        return residual
    heads = config.num_heads // tp
    q, f = heads * hd, config.ffn_hidden_size // tp
    kv = _kv_width(config, tp)
    if tp == 1:  # fused q/k/v: v is a view of the projection output, which stays alive whole
        qkv = tokens * (2 * q + 3 * kv) * c
        gate_up = config.activation in GATED_ACTIVATIONS and config.num_experts is None  # fused
        weights = (q + 2 * kv) * h * c + (2 * f * h * c if gate_up else 0)
    else:  # kv heads replicated: this rank's head is a view of the whole v projection output
        v = config.num_kv_heads * hd if kv_replicated(config, tp) else kv
        qkv = tokens * (q + kv + v) * c
        weights = 0
    stat = _norm_stat(config)
    norm_in = 1 if config.parallel_attn else 2  # a parallel block's norms share their input
    if config.sandwich_norm:  # the attention's and the MLP's outputs, normed before the residual add
        norm_in += 2
    # Norm outputs the projections read; with sequence parallel each of attention and MLP gathers its own.
    norm_out = 1 if config.parallel_attn and config.num_ln_in_parallel_attn == 1 and sp == 1 else 2
    norms = norm_in * (residual + math.ceil(tokens / sp) * stat) + norm_out * tokens * h * c
    if sp > 1:  # measured: nn.RMSNorm on a sequence shard saves its normalised input too, and a
        # block one more shard besides
        norms += norm_in * _plain_norm_extra(config, residual, c) + residual
    if config.qk_norm:  # per-head q/k norms: their fp32 rstd per head, and at tp > 1 their inputs
        # (the unfused projections' outputs, otherwise freed by RoPE; at tp 1 views of the kept q/k/v)
        total_heads = heads + kv // hd
        norms += tokens * total_heads * 4
        if tp > 1:
            head_in = tokens * (q + kv) * c
            norms += head_in + (
                _plain_norm_extra(config, head_in, c) if config.norm == "rmsnorm_plus1" else 0
            )
    o_proj_in = tokens * q * c
    kernel = tokens * q * c + micro * heads * local * 4  # the kernel's output and log-sum-exp
    window = attention_window(config, layer)
    if cp > 1:  # selective recompute reruns the cp kernel whole, its gather included
        kernel += _cp_attention(config, par, micro, seq, kv, layer, attention)
    elif window is not None and seq > window and attention != "flash":
        kernel += seq * seq * c  # SDPA's additive mask
    mlp = (4 if config.activation in GATED_ACTIVATIONS else 2) * tokens * f * c
    if config.num_experts is not None:
        mlp = _moe_activations(config, tokens, c, tp)
    total = norms + qkv + o_proj_in + mlp + weights
    return total if mode == "selective" else total + kernel


def _layer_kinds(config: ModelConfig, layers: Sequence[int]) -> dict[int, int]:
    """A layer of each kind among `layers` (their window: what `layer_activations` reads of a layer)
    and how many of `layers` are of its kind; the planner's long-sequence search sizes a layer once."""
    if config.layer_types is None:  # every layer alike
        return {layers[0]: len(layers)} if len(layers) else {}
    kinds: dict[int | None, list[int]] = {}
    for i in layers:
        kinds.setdefault(attention_window(config, i), []).append(i)
    return {same[0]: len(same) for same in kinds.values()}


def fused_loss(par: Parallelism) -> bool:
    """The loss is fused with the output projection (no tp, no pipeline), else vocab-parallel logits."""
    return par.spec.tp == 1 and par.spec.pp * par.stages_per_rank == 1


def stage_activations(
    config: ModelConfig, par: Parallelism, stage: int, micro: int, seq: int, attention: str = "sdpa"
) -> int:
    """Bytes a pipeline stage (or the whole model) saves for one microbatch."""
    return _stage_activations(config, par, check_parallelism(config, par), stage, micro, seq, attention)


def _stage_activations(
    config: ModelConfig,
    par: Parallelism,
    layers: list[list[int]],
    stage: int,
    micro: int,
    seq: int,
    attention: str,
) -> int:
    first, last, pipelined = stage == 0, stage == len(layers) - 1, len(layers) > 1
    c, tp, cp = COMPUTE_BYTES[par.precision], par.spec.tp, par.spec.cp
    tokens, h = micro * seq // cp, config.hidden_size
    residual = math.ceil(tokens / _seq_shard(par)) * h * c
    total = sum(
        n * layer_activations(config, par, micro, seq, attention=attention, layer=i)
        for i, n in _layer_kinds(config, layers[stage]).items()
    )
    tables = len({local_rope(config, i) for i in _layer_kinds(config, layers[stage])}) or 1  # Gemma 3
    # The RoPE tables (cos and sin): [S, 1, hd]; under cp per row, [b, S / cp, 1, hd] (positions given)
    total += tables * 2 * (tokens if cp > 1 else seq) * config.head_dim * c
    if first:
        total += tokens * 8  # token ids, for the embedding's backward
    else:
        total -= residual  # the first block's input is a receive buffer (`rank_buffers`)
    if last:
        stat = _norm_stat(config)
        total += residual + math.ceil(tokens / _seq_shard(par)) * stat  # the final norm's input
        if _seq_shard(par) > 1:  # and what it saves besides on a sequence shard (plain ops)
            total += _plain_norm_extra(config, residual, c)
        vocab = config.padded_vocab_size
        if fused_loss(par):
            total += tokens * h * c + vocab * h * c  # the gradients the fused loss computed in forward
        else:
            local_vocab = vocab // tp
            total += tokens * h * c + tokens * local_vocab * 4  # the head's input, fp32 log-softmax
            if pipelined:
                total += tokens * local_vocab * c  # logits: the stage's output, kept for its backward
    elif pipelined:
        total += residual  # the stage's output, kept for its backward
    return total


def in_flight(par: Parallelism, pp_rank: int) -> int:
    """Microbatch-chunks whose activations pipeline rank `pp_rank` holds at its peak (module docstring)."""
    P, m, v = par.spec.pp, par.microbatches, par.stages_per_rank
    schedule = par.spec.schedule
    if P * v == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, P - pp_rank)
    if schedule == "zbv":
        return min(2 * m, 2 * P)
    per_round = m // max(1, m // P)
    hop = 2 if schedule == "interleaved1f1b" else 1
    return min(m * v, (v - 1) * per_round + hop * (P - 1 - pp_rank) + 1)


def rank_activations(
    config: ModelConfig, par: Parallelism, pp_rank: int, micro: int, seq: int, attention: str = "sdpa"
) -> int:
    """Bytes of activations pipeline rank `pp_rank` holds at its peak: its in-flight chunks (of its
    local stages, on average) and, with full recompute, one layer recomputed in the backward."""
    stages, layers = par.rank_stages(pp_rank), check_parallelism(config, par)
    chunks = [_stage_activations(config, par, layers, s, micro, seq, attention) for s in stages]
    per_chunk = sum(chunks) / len(chunks)
    total = round(in_flight(par, pp_rank) * per_chunk)
    if par.recompute == "full":  # the largest layer (a sliding one may add its mask)
        total += max(
            layer_activations(config, par, micro, seq, "none", attention, i)
            for i in _layer_kinds(config, range(config.num_layers))
        )
    return total


# --- buffers -------------------------------------------------------------------------------------

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def rank_buffers(config: ModelConfig, par: Parallelism, dp: int, pp_rank: int, micro: int, seq: int) -> int:
    """Transient and bookkeeping bytes on a rank, all counted at once (module docstring)."""
    tensors = _rank_tensors(config, par, pp_rank)
    return _param_buffers(config, par, dp, pp_rank, tensors) + _token_buffers(
        config, par, pp_rank, micro, seq
    )


def _param_buffers(
    config: ModelConfig, par: Parallelism, dp: int, pp_rank: int, tensors: list[tuple[str, tuple[int, ...]]]
) -> int:
    """The buffers the parameters size: FSDP2's, or a compute-dtype gradient without it."""
    num_stages, c = par.spec.pp * par.stages_per_rank, COMPUTE_BYTES[par.precision]
    replicas = _replicas(par, dp)
    if fsdp_wrapped(par, replicas):
        root, blocks, float8 = 0, {}, {}
        gathers8 = float8_all_gather(par, replicas)
        for name, shape in tensors:
            m = _BLOCK.match(name)
            if m:
                blocks[m.group(1)] = blocks.get(m.group(1), 0) + math.prod(shape)
                if gathers8 and float8_weight(name, shape):  # (by the rank's shapes: tp's pieces)
                    float8[m.group(1)] = float8.get(m.group(1), 0) + math.prod(shape)
            else:
                root += math.prod(shape)
        block = max(blocks.values(), default=0)
        unsharded = root + 2 * block if num_stages == 1 else root + sum(blocks.values())
        in_float8 = 2 * max(float8.values(), default=0) if num_stages == 1 else sum(float8.values())
        # Unsharded parameters in the compute dtype (float8 weights gathered in 1 byte); a
        # reduction's gradients in it and in fp32.
        total = unsharded * c - in_float8 * (c - 1) + max(root, block) * (c + 4)
        if par.microbatches > 1:
            # Gradient sync is off for every microbatch but the last (`ParallelModel._grad_sync`, the
            # pipeline stage's no-sync backward): FSDP2 then accumulates unsharded fp32 gradients.
            total += (root + sum(blocks.values())) * 4
        return total
    if compute_copies(par, replicas):
        return max(math.prod(shape) for _, shape in tensors) * c
    return 0


def _token_buffers(config: ModelConfig, par: Parallelism, pp_rank: int, micro: int, seq: int) -> int:
    """The buffers the tokens size: a pipeline's receive buffers, cp's gradients, ep's all-to-all
    buffers, the loss's."""
    num_stages, stages = par.spec.pp * par.stages_per_rank, par.rank_stages(pp_rank)
    c, tp, cp = COMPUTE_BYTES[par.precision], par.spec.tp, par.spec.cp
    tokens = micro * seq // cp
    residual = math.ceil(tokens / _seq_shard(par)) * config.hidden_size * c
    total = 0
    if num_stages > 1:  # torch's PipelineStage allocates its receive buffers for every microbatch
        for s in stages:
            total += ((s > 0) + (s < num_stages - 1)) * par.microbatches * residual
    if cp > 1:  # a layer's gathered k and v gradients, the whole sequence's, before the reduce-scatter
        total += 2 * micro * seq * _kv_width(config, tp) * c
    if par.spec.ep > 1:  # a layer's routed rows as sent and as received, in each all-to-all
        total += 2 * tokens * config.experts_per_token * config.hidden_size * c
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


def _fixed_bytes(
    config: ModelConfig, par: Parallelism, dp: int, tensors: list[list[tuple[str, tuple[int, ...]]]]
) -> list[int]:
    """Per pipeline rank (its `tensors`), what neither the sequence nor recompute changes: dp rank
    0's state (FSDP2's first chunks are the longest) and the parameters' buffers."""
    return [
        _state(config, par, dp, 0, t).total + _param_buffers(config, par, dp, r, t)
        for r, t in enumerate(tensors)
    ]


def _peak_bytes(
    config: ModelConfig, par: Parallelism, fixed: list[int], micro: int, seq: int, attention: str
) -> int:
    """The fullest rank's bytes, as `peak(estimate(..., all_dp_ranks=False))`, from `_fixed_bytes`."""
    return max(
        b
        + rank_activations(config, par, r, micro, seq, attention)
        + _token_buffers(config, par, r, micro, seq)
        for r, b in enumerate(fixed)
    )


Tensors = Callable[[Parallelism], list[list[tuple[str, tuple[int, ...]]]]]


def _tensor_cache(config: ModelConfig) -> Tensors:
    """Each pipeline rank's tensors by tp x pp x ep, for a search of many layouts: they do not
    depend on cp, dp, recompute or the microbatches (the caller checks those: `check_parallelism`)."""
    cache: dict[tuple[int, int, int], list[list[tuple[str, tuple[int, ...]]]]] = {}

    def tensors(par: Parallelism) -> list[list[tuple[str, tuple[int, ...]]]]:
        key = (par.spec.tp, par.spec.pp, par.spec.ep)
        if key not in cache:
            cache[key] = [_rank_tensors(config, par, r) for r in range(par.spec.pp)]
        return cache[key]

    return tensors


# --- per rank ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes (or several ranks' with the same numbers: `ranks`)."""

    ranks: tuple[int, ...]
    pp_rank: int
    weights: int
    grads: int
    optimizer: int
    copies: int
    activations: int
    buffers: int
    in_flight: int

    @property
    def state(self) -> int:
        return self.weights + self.grads + self.optimizer + self.copies

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
    pipeline rank, more when FSDP2's chunks differ over dp. `all_dp_ranks=False` computes dp rank 0
    only (the fullest: FSDP2's first chunks are the longest), for the peak."""
    check_parallelism(config, par)
    # Global ranks run (pp, dp, cp, tp), tp fastest: FSDP2's flattened dp x cp index is the next.
    tp, replicas = par.spec.tp, _replicas(par, dp)
    rows: list[RankMemory] = []
    for pp_rank in range(par.spec.pp):
        tensors = _rank_tensors(config, par, pp_rank)
        activations = rank_activations(config, par, pp_rank, micro, seq, attention)
        buffers = _param_buffers(config, par, dp, pp_rank, tensors) + _token_buffers(
            config, par, pp_rank, micro, seq
        )
        by_state: dict[State, list[int]] = {}
        shards = _shard_groups(config, par, tensors)
        for dp_rank in range(replicas if _dp_sharded(par, dp) and all_dp_ranks else 1):
            by_state.setdefault(_state(config, par, dp, dp_rank, tensors, shards), []).append(dp_rank)
        if not _dp_sharded(par, dp):  # whole parameters on every dp (and cp) rank
            by_state = {st: list(range(replicas)) for st in by_state}
        for st, dp_ranks in by_state.items():
            ranks = tuple((pp_rank * replicas + d) * tp + t for d in dp_ranks for t in range(tp))
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


# --- layouts -------------------------------------------------------------------------------------

# cp's exposed collectives in time (`relative_throughput`), for an H100-class GPU: the FLOP/s a
# training step achieves, the bytes/s its link moves within a node (NVLink) and across nodes
# (InfiniBand), and a collective's latency.
ACHIEVED_FLOPS = 400e12
NODE_BANDWIDTH = 400e9
NETWORK_BANDWIDTH = 50e9
COLLECTIVE_LATENCY = 20e-6


def _cp_cost(config: ModelConfig, par: Parallelism, seq: int, micro: int, gpus_per_node: int) -> float:
    """Time of a layer's cp collectives over the time of its compute, for one microbatch on a rank.
    Each of k and v is all-gathered in the forward (again when recomputed) and its gradient
    reduce-scattered in the backward, every rank moving cp - 1 parts of T x kv width; none is
    overlapped with compute (`cp.py` waits for them)."""
    cp, tp, c = par.spec.cp, par.spec.tp, COMPUTE_BYTES[par.precision]
    tokens = micro * seq // cp
    passes = 2 if par.recompute == "none" else 3
    bandwidth = NODE_BANDWIDTH if tp * cp <= gpus_per_node else NETWORK_BANDWIDTH
    moved = (cp - 1) * tokens * _kv_width(config, tp) * c
    comm = passes * 2 * (COLLECTIVE_LATENCY + moved / bandwidth)
    compute = tokens * flops_per_token(config, seq) / (config.num_layers * tp * ACHIEVED_FLOPS)
    return comm / compute


def _ep_cost(config: ModelConfig, par: Parallelism, seq: int, micro: int, gpus_per_node: int) -> float:
    """Time of a layer's ep all-to-alls over the time of its compute, for one microbatch on a rank:
    the routed rows (T x k) sent to their experts and back in the forward, and their gradients in
    the backward (again in the forward when recomputed in full), each moving the (ep-1)/ep of
    the rows that leave the rank; none overlapped. ep's ranks are tp x cp apart (`build_mesh`)."""
    ep, tp, c = par.spec.ep, par.spec.tp, COMPUTE_BYTES[par.precision]
    tokens = micro * seq
    passes = 6 if par.recompute == "full" else 4
    bandwidth = NODE_BANDWIDTH if tp * par.spec.cp * ep <= gpus_per_node else NETWORK_BANDWIDTH
    moved = (ep - 1) / ep * tokens * config.experts_per_token * config.hidden_size * c
    comm = passes * (COLLECTIVE_LATENCY + moved / bandwidth)
    compute = tokens * flops_per_token(config, seq) / (config.num_layers * tp * ACHIEVED_FLOPS)
    return comm / compute


def relative_throughput(
    config: ModelConfig,
    par: Parallelism,
    dp: int,
    seq: int,
    gpus_per_node: int = GPUS_PER_NODE,
    micro: int = 1,
) -> float:
    """Expected throughput relative to a perfect machine of the same GPUs (module docstring)."""
    tp, P, v, m = par.spec.tp, par.spec.pp, par.stages_per_rank, par.microbatches
    eff = 1.0 - TP_COST * math.log2(min(tp, gpus_per_node))
    if tp > gpus_per_node:
        eff *= 0.5
    if P > 1:
        bubble = (P - 1) / (v * m + P - 1)
        eff *= 1.0 - (bubble / 3 if par.spec.schedule in ZERO_BUBBLE else bubble)
    if par.recompute == "full":
        eff *= 0.75
    elif par.recompute == "selective":
        attention_forward = 4.0 * config.num_layers * config.num_heads * config.head_dim * seq
        eff /= 1.0 + attention_forward / flops_per_token(config, seq)
    if par.spec.cp > 1:
        eff /= 1.0 + _cp_cost(config, par, seq, micro, gpus_per_node)
    if par.spec.ep > 1:
        eff /= 1.0 + _ep_cost(config, par, seq, micro, gpus_per_node)
    if _replicas(par, dp) > 1:  # FSDP2 over dp x cp
        eff *= DP_EFFICIENCY
    return eff


def layout_label(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> str:
    """'tp 2 x pp 1 x dp 4'; 'tp 2 x pp 1 x cp 4 x dp 1' with context parallel (the mesh's order);
    'tp 1 x pp 2 x dp 8 (ep 8)' with expert parallel, ep ranks being dp ranks."""
    cp_part = f"cp {cp} x " if cp > 1 else ""
    return f"tp {tp} x pp {pp} x {cp_part}dp {dp}" + (f" (ep {ep})" if ep > 1 else "")


@dataclass(frozen=True)
class Candidate:
    """A layout of the GPUs: its peak rank's bytes and expected throughput, or why it is refused."""

    tp: int
    pp: int
    dp: int
    recompute: str
    microbatches: int
    peak: int  # bytes on the fullest rank, ALLOWANCE not included; 0 when refused
    throughput: float  # `relative_throughput`; 0 when refused or not fitting
    fits: bool
    reason: str = ""  # why it does not fit or is refused
    cp: int = 1
    ep: int = 1

    @property
    def label(self) -> str:
        return f"{layout_label(self.tp, self.pp, self.dp, self.cp, self.ep)}, recompute {self.recompute}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_parallelism(
    base: Parallelism, tp: int, pp: int, microbatches: int, recompute: str, cp: int = 1, ep: int = 1
) -> Parallelism:
    """The run's settings with another tp/pp/cp/ep: no pipeline settings without a pipeline, the
    run's per-stage layer counts only with its own pp."""
    spec = msgspec.structs.replace(base.spec, cp=cp, ep=ep)
    if pp == 1:
        spec = msgspec.structs.replace(spec, tp=tp, pp=1, pp_layers=None, schedule="1f1b", virtual_stages=1)
    else:
        layers = spec.pp_layers if pp == spec.pp else None
        spec = msgspec.structs.replace(spec, tp=tp, pp=pp, pp_layers=layers)
    return dataclasses.replace(base, spec=spec, microbatches=microbatches, recompute=recompute)


Layout = tuple[int, int, int, int, int]  # tp, pp, cp, dp, ep


def _layouts(config: ModelConfig, base: Parallelism, gpus: int, seq: int | None) -> list[Layout]:
    """(tp, pp, cp, dp, ep) of `gpus`, cp only where it can split `seq` (`check_cp`; any with
    None), ep > 1 for a mixture of experts whose experts and dp it divides (FSDP2's dp mode)."""
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                if cp > 1 and seq is not None:
                    try:
                        check_cp(seq, cp, tp, base.spec.sequence_parallel)
                    except UserError:
                        continue
                dp = gpus // (tp * pp * cp)
                experts = config.num_experts if base.spec.dp_mode == "fsdp" else None
                for ep in _divisors(math.gcd(dp, experts)) if experts else [1]:
                    out.append((tp, pp, cp, dp, ep))
    return out


def _candidate(
    config: ModelConfig,
    base: Parallelism,
    layout: Layout,
    gpu_memory: int,
    micro: int,
    seq: int,
    global_batch: int,
    attention: str,
    gpus_per_node: int,
    tensors: Tensors,
) -> Candidate:
    """A layout with the least recompute that fits, or its largest peak, or why it is refused."""
    tp, pp, cp, dp, ep = layout
    if global_batch % (micro * dp):
        why = f"batch {global_batch} does not divide into micro {micro} x dp {dp}"
        return Candidate(tp, pp, dp, "-", 0, 0, 0.0, False, why, cp, ep)
    m = global_batch // (micro * dp)
    par = candidate_parallelism(base, tp, pp, m, "none", cp, ep)
    try:
        check_parallelism(config, par)
    except UserError as e:
        return Candidate(tp, pp, dp, "-", m, 0, 0.0, False, str(e), cp, ep)
    fixed = _fixed_bytes(config, par, dp, tensors(par))
    for recompute in RECOMPUTE:
        par = candidate_parallelism(base, tp, pp, m, recompute, cp, ep)
        need = _peak_bytes(config, par, fixed, micro, seq, attention)
        if need + ALLOWANCE <= gpu_memory:
            eff = relative_throughput(config, par, dp, seq, gpus_per_node, micro)
            return Candidate(tp, pp, dp, recompute, m, need, eff, True, "", cp, ep)
    return Candidate(tp, pp, dp, recompute, m, need, 0.0, False, "does not fit", cp, ep)


def _rank(c: Candidate) -> tuple:
    """Fitting ones by throughput, then the others by their peak, the refused ones last."""
    return (not c.fits, -c.throughput, c.peak or math.inf)


def search(
    config: ModelConfig,
    base: Parallelism,
    gpus: int,
    gpu_memory: int,
    micro: int,
    seq: int,
    global_batch: int,
    attention: str = "sdpa",
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Candidate]:
    """Every tp x pp x cp x dp = `gpus` layout (and every ep of a mixture of experts) with the
    least recompute that fits `gpu_memory` (with ALLOWANCE); the fitting ones first, best expected
    throughput first, then the others. A cp > 1 layout only where it beats the same tp x pp with
    its cp ranks as dp ones (same state sharding; cp costs its collectives): it fits where that
    does not, or runs faster."""
    if gpus < 1:
        raise UserError(f"must be at least 1, got {gpus}", "--gpus")
    tensors = _tensor_cache(config)
    found = {
        (tp, pp, cp, ep): _candidate(
            config,
            base,
            (tp, pp, cp, dp, ep),
            gpu_memory,
            micro,
            seq,
            global_batch,
            attention,
            gpus_per_node,
            tensors,
        )
        for tp, pp, cp, dp, ep in _layouts(config, base, gpus, seq)
    }
    out = [c for (tp, pp, cp, ep), c in found.items() if cp == 1 or _rank(c) < _rank(found[tp, pp, 1, ep])]
    return sorted(out, key=_rank)


# --- the longest sequence ----------------------------------------------------------------------------

MAX_SEQ = 1 << 24  # where the search for the longest sequence stops (16,777,216 tokens)


def seq_multiple(par: Parallelism) -> int:
    """What a seq_length must be a multiple of (`check_cp`): 2 x cp, and cp x tp too with sequence
    parallel; anything without cp."""
    cp, tp = par.spec.cp, par.spec.tp
    if cp == 1:
        return 1
    return math.lcm(2 * cp, cp * tp) if par.spec.sequence_parallel else 2 * cp


def longest_sequence(
    config: ModelConfig, par: Parallelism, dp: int, micro: int, gpu_memory: int, attention: str = "sdpa"
) -> int:
    """The longest seq_length, a multiple of `seq_multiple`, at which the fullest rank of `par`
    fits `gpu_memory` with ALLOWANCE; 0 when not even the shortest fits, MAX_SEQ (rounded up to the
    multiple) when that does."""
    check_parallelism(config, par)
    fixed = _fixed_bytes(config, par, dp, _tensor_cache(config)(par))
    return _longest(config, par, fixed, micro, gpu_memory, attention)


def _longest(
    config: ModelConfig,
    par: Parallelism,
    fixed: list[int],
    micro: int,
    gpu_memory: int,
    attention: str,
    too_long: int | None = None,
) -> int:
    """`longest_sequence` from `_fixed_bytes`: a bisection, the peak growing with the sequence.
    `too_long`: a seq_length known not to fit (a multiple of `seq_multiple`), the search's bound."""
    step = seq_multiple(par)

    def fits(k: int) -> bool:
        return _peak_bytes(config, par, fixed, micro, k * step, attention) + ALLOWANCE <= gpu_memory

    limit = -(-MAX_SEQ // step)  # the first multiple at or past MAX_SEQ
    if not fits(1):
        return 0
    if too_long is None:  # double until one does not fit: fits(lo), not fits(hi)
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, 2 * hi
        if hi > limit:
            if fits(limit):
                return limit * step
            hi = limit
    else:
        lo, hi = 1, min(too_long // step, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


@dataclass(frozen=True)
class Longest:
    """A layout of the GPUs and the longest sequence each recompute fits (0: none)."""

    tp: int
    pp: int
    cp: int
    dp: int
    microbatches: int
    seq: dict[str, int]  # by recompute: none, selective, full
    throughput: float  # `relative_throughput` at the longest sequence, recompute full
    ep: int = 1

    @property
    def label(self) -> str:
        return layout_label(self.tp, self.pp, self.dp, self.cp, self.ep)


def longest_sequences(
    config: ModelConfig,
    base: Parallelism,
    gpus: int,
    gpu_memory: int,
    micro: int,
    global_batch: int,
    attention: str = "sdpa",
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Longest]:
    """Every tp x pp x cp x dp (x ep) = `gpus` layout the batch divides into, longest sequence first (full
    recompute's; then the faster at it); the run's micro batch, global batch and other settings."""
    out, tensors = [], _tensor_cache(config)
    for tp, pp, cp, dp, ep in _layouts(config, base, gpus, None):
        if global_batch % (micro * dp):
            continue
        m = global_batch // (micro * dp)
        pars = {r: candidate_parallelism(base, tp, pp, m, r, cp, ep) for r in RECOMPUTE}
        try:
            check_parallelism(config, pars["full"])
        except UserError:  # fewer microbatches than stages, say
            continue
        fixed = _fixed_bytes(config, pars["full"], dp, tensors(pars["full"]))
        full = _longest(config, pars["full"], fixed, micro, gpu_memory, attention)
        # Full recompute saves the least: no other fits a sequence it does not.
        too_long = full + seq_multiple(pars["full"])
        seq = {
            r: _longest(config, pars[r], fixed, micro, gpu_memory, attention, too_long) if full else 0
            for r in RECOMPUTE
            if r != "full"
        }
        eff = relative_throughput(config, pars["full"], dp, full, gpus_per_node, micro) if full else 0.0
        out.append(Longest(tp, pp, cp, dp, m, seq | {"full": full}, eff, ep))
    return sorted(out, key=lambda c: (-c.seq["full"], -c.throughput))


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str, where: str = "--gpu-memory") -> int:
    """Bytes from '80GB', '80G', '80GiB', '81920MiB' or '4096B'. Units are binary (80GB = 80 GiB), as
    GPU memory is sold and reported (nvidia-smi: 81920MiB on an 80 GB A100). A bare number is
    refused: `--gpu-memory 80` means 80 GB, never 80 bytes."""
    m = SIZE.match(text)
    if m is None:
        raise UserError(f"{text!r} is not a memory size such as 80GB or 81920MiB", where)
    if m.group(2) is None:
        raise UserError(f"{m.group(1)} has no unit: did you mean {m.group(1)}GB?", where)
    unit = m.group(2).lower()
    power = "bkmgt".index(unit[0])
    value = float(m.group(1)) * (1 << (10 * power))
    if value < 1:
        raise UserError(f"{text!r} is not a positive memory size", where)
    return int(value)
