"""The layout: where each of a model's tensors lives for a tp/pp/dp layout, and every check that
refuses an impossible layout before any process starts (docs/architecture.md). The mesh's sizes
and the engine's settings are `dims.py`'s, how the engine builds a stage `build_rules.py`'s.

Pure functions of the model config and the sizes, no torch: mega-shard's box arithmetic, the
tensor-parallel styles (`tp.apply_tp` builds them from `place`), the engine, the live-model
save/load and mega-train's dry run all use these, so every layout agrees on what a rank holds.

Tensor names follow the model naming contract (`megacore.parts.model_tensors`). Optimizer state
is stored in the same checkpoint `tensors` map under `optim.<kind>.<param name>` (AdamW:
`optim.exp_avg.<param>` and `optim.exp_avg_sq.<param>`), with the parameter's global shape, split
exactly like its parameter; scalar state such as the step count lives in the manifest's `training`
section.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from megacore.artifacts.pieces import Box, even_split, whole
from megacore.config import (
    NF4_BLOCK,
    OPTIM_PREFIX,
    ModelConfig,
    is_adapter_tensor,
    is_block_projection,
    nf4_scaler_block,
)
from megacore.errors import UserError
from megacore.parallel.build_rules import fsdp_wrapped, nf4_base
from megacore.parallel.dims import (
    MULTI_STAGE,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    Dims,
    Parallelism,
    check_positive,
)
from megacore.parts import linear, model_tensors, tp_dim
from megacore.parts.attention import kv_replicated
from megacore.parts.moe import is_expert_tensor

ADAMW_STATE_KINDS = ("exp_avg", "exp_avg_sq")

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def optim_state_name(kind: str, param: str) -> str:
    """Checkpoint name of an optimizer state tensor: `optim.<kind>.<param>`."""
    return f"{OPTIM_PREFIX}{kind}.{param}"


def split_optim_name(name: str) -> tuple[str | None, str]:
    """(state kind, parameter name) of a checkpoint tensor name; kind is None for a parameter."""
    if not name.startswith(OPTIM_PREFIX):
        return None, name
    rest = name[len(OPTIM_PREFIX) :]
    kind, _, param = rest.partition(".")
    if not kind or not param:
        raise UserError(f"optimizer state name {name!r} is not optim.<kind>.<param>", name)
    return kind, param


@dataclass(frozen=True)
class TensorPlace:
    """Where a tensor lives: on the stage holding `layer`, or on the first / last stage, split over
    tp along `tp_dim` (None: replicated over tp, stored once, with tp rank 0)."""

    layer: int | None
    where: str  # "layer", "first" or "last"
    tp_dim: int | None


def place(name: str, config: ModelConfig, tp: int) -> TensorPlace:
    """The placement of a checkpoint tensor (parameter or optimizer state) under tensor parallel `tp`.
    A LoRA adapter's follow its linear's (`_adapter_place`)."""
    _, param = split_optim_name(name)
    if is_adapter_tensor(param):
        return _adapter_place(param, config, tp)
    if param == "embed.weight":
        return TensorPlace(None, "first", 0)
    if param == "lm_head.weight":
        return TensorPlace(None, "last", 0)
    if param in ("norm.weight", "norm.bias"):
        return TensorPlace(None, "last", None)
    m = _LAYER.match(param)
    if m is None:
        raise UserError(f"tensor {name!r} is not a name of the model contract; cannot place it", name)
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= config.num_layers:
        raise UserError(f"tensor {name!r}: layer {layer} is beyond num_layers {config.num_layers}", name)
    try:
        return TensorPlace(layer, "layer", tp_dim(config, layer, rest, tp))  # its parts' own tables
    except KeyError:
        raise UserError(
            f"tensor {name!r} is not a name of the model contract; cannot place it", name
        ) from None


def _adapter_place(name: str, config: ModelConfig, tp: int) -> TensorPlace:
    """A LoRA adapter on a column-parallel linear (split on its output rows): A [rank, in]
    replicated, B [out, rank] split on its rows like the weight; on a row-parallel one (split on
    its input columns): A split on its columns, B replicated. Each rank's B A x is then what its
    part of the linear's output needs, with no communication of its own."""
    module, _, tensor = name.removesuffix(".weight").rpartition(".")
    base = place(f"{module}.weight", config, tp)
    if tensor == "lora_A":
        return TensorPlace(base.layer, base.where, 1 if base.tp_dim == 1 else None)
    return TensorPlace(base.layer, base.where, 0 if base.tp_dim == 0 else None)


def is_experts(name: str) -> bool:
    """Whether a checkpoint tensor is a mixture of experts' stacked experts' weight or bias (dim 0:
    the experts, expert parallel's split)."""
    return is_expert_tensor(split_optim_name(name)[1])


def tp_box(p: TensorPlace, shape: Sequence[int], tp: int, rank: int) -> Box:
    """The part of a tensor of `shape` that tensor-parallel rank `rank` holds (all of it when the
    tensor is replicated)."""
    return whole(shape) if p.tp_dim is None else even_split(shape, p.tp_dim, tp)[rank]


def stage_of(p: TensorPlace, stage_layers: Sequence[Sequence[int]]) -> int:
    if p.where == "first":
        return 0
    if p.where == "last":
        return len(stage_layers) - 1
    for s, layers in enumerate(stage_layers):
        if p.layer in layers:
            return s
    raise ValueError(f"layer {p.layer} is on no stage")


# --- checks --------------------------------------------------------------------------------------


def check_tp(config: ModelConfig, tp: int, where: str = "tp") -> None:
    """tp must divide the heads, the kv heads (or be a multiple of them), the ffn and the padded vocab."""
    check_positive(tp, "tp", where)
    if config.num_heads % tp:
        raise UserError(f"tp {tp} does not divide the {config.num_heads} attention heads", where)
    kv = config.num_kv_heads
    if kv >= tp and kv % tp:
        raise UserError(f"tp {tp} does not divide the {kv} kv heads (nor is a multiple of them)", where)
    if kv < tp and tp % kv:
        raise UserError(f"tp {tp} is neither a divisor nor a multiple of the {kv} kv heads", where)
    if config.ffn_hidden_size % tp:
        raise UserError(f"tp {tp} does not divide the ffn hidden size {config.ffn_hidden_size}", where)
    if config.linear_attention is not None and (why := linear.check_tp(config, tp)):
        raise UserError(why, where)
    pv = config.padded_vocab_size
    if pv % tp:
        raise UserError(
            f"tp {tp} does not divide the padded vocab size {pv}; pad the vocab to a multiple of tp "
            "(padded_vocab_size) when converting",
            where,
        )


def check_ep(config: ModelConfig, ep: int, where: str = "ep") -> None:
    """ep splits the experts of every MoE layer: a mixture of experts with a multiple of ep experts."""
    check_positive(ep, "ep", where)
    if ep > 1 and (config.moe is None or config.moe.num_experts % ep):
        experts = "no experts" if config.moe is None else f"{config.moe.num_experts} experts"
        raise UserError(f"ep {ep} splits a mixture of experts' experts: the model has {experts}", where)


def stage_layers(
    num_layers: int, stages: int, counts: Sequence[int] | None = None, where: str = "pp"
) -> list[list[int]]:
    """The global layer indices of each pipeline stage: an even split (the first stages take one
    more when it does not divide), or explicit per-stage `counts`."""
    check_positive(stages, "pp", where)
    if stages > num_layers:
        raise UserError(f"{stages} pipeline stages exceed the model's {num_layers} layers", where)
    if counts is None:
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        counts = list(counts)
        if len(counts) != stages:
            raise UserError(f"{len(counts)} per-stage layer counts given for {stages} stages", where)
        if any(c < 1 for c in counts):
            raise UserError(f"every stage needs at least one layer, got {counts}", where)
        if sum(counts) != num_layers:
            raise UserError(
                f"per-stage layer counts {counts} sum to {sum(counts)}, the model has {num_layers}", where
            )
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def _field(where: str, name: str) -> str:
    """A top-level run field beside `where`'s parallel section: 'run.json: $.parallel' ->
    'run.json: $.precision'."""
    return where.replace("$.parallel", f"$.{name}") if "$.parallel" in where else name


def check_parallelism(config: ModelConfig, par: Parallelism, where: str = "$.parallel") -> list[list[int]]:
    """Every check of the engine's layout that needs no processes; returns the layers of each stage."""
    spec = par.spec
    if spec.schedule not in SCHEDULES:
        raise UserError(
            f"unknown schedule {spec.schedule!r}; choose one of {sorted(SCHEDULES)}", f"{where}.schedule"
        )
    if spec.schedule not in MULTI_STAGE and spec.virtual_stages != 1:
        raise UserError(
            f"schedule {spec.schedule!r} runs one stage per rank; virtual_stages must be 1", where
        )
    if par.precision not in PRECISIONS:
        raise UserError(
            f"must be one of {list(PRECISIONS)}, got {par.precision!r}", _field(where, "precision")
        )
    if par.recompute not in RECOMPUTE:
        raise UserError(
            f"must be one of {list(RECOMPUTE)}, got {par.recompute!r}", _field(where, "recompute")
        )
    check_tp(config, spec.tp, f"{where}.tp")
    check_ep(config, spec.ep, f"{where}.ep")
    if (
        par.precision == "fp8"
        and spec.tp > 1
        and (par.fp8_scaling != "tensorwise" or kv_replicated(config, spec.tp))
    ):
        raise UserError(
            "fp8 under tensor parallel takes tensorwise scaling and tp up to the kv heads "
            f"({config.num_kv_heads}): torchao's float8 styles",
            _field(where, "fp8_scaling") if par.fp8_scaling != "tensorwise" else f"{where}.tp",
        )
    if spec.ep > 1 and spec.dp_mode != "fsdp":
        raise UserError("expert parallel shards the other weights with FSDP2 (dp_mode fsdp)", f"{where}.ep")
    if config.linear_attention is not None and spec.cp > 1:
        raise UserError(
            "cp splits rows across ranks, which linear attention's state cannot cross here: cp 1",
            f"{where}.cp",
        )
    if par.router.aux_loss_coef and spec.cp > 1:  # the rest of a router is per token
        raise UserError(
            "a mixture of experts' load-balancing loss takes whole rows: cp 1, or $.model.router_aux_loss_coef 0",
            f"{where}.cp",
        )
    stages = spec.pp * par.stages_per_rank
    layers = stage_layers(
        config.num_layers, stages, spec.pp_layers, f"{where}.pp_layers" if spec.pp_layers else f"{where}.pp"
    )
    check_positive(par.microbatches, "microbatches", where)
    if spec.pp > 1 and par.microbatches < spec.pp and spec.schedule != "gpipe":
        raise UserError(
            f"{par.microbatches} microbatches are fewer than the {spec.pp} pipeline stages", where
        )
    return layers


def fsdp_dim(name: str, shape: Sequence[int], tp_dim: int | None = None) -> int:
    """The dim FSDP2 shards parameter `name` of `shape` on: 0, but a stacked experts tensor's rows
    or columns: its dim 0, the experts (Mixtral's 8), is smaller than many dp sizes and would leave
    ranks empty (and is expert parallel's); its other dims split evenly. Dim 1, or 2 where tp
    splits dim 1 (`tp_dim`, when tp > 1): two splits of one dim would interleave (FSDP2's strided
    shards), which a checkpoint's boxes cannot say. An experts' bias [experts, out] split by tp on
    its dim 1 has dim 0 left (`check_sharding` keeps that to layouts it divides evenly)."""
    if not is_experts(name):
        return 0
    if len(shape) == 2:
        return 0 if tp_dim == 1 else 1
    return 2 if tp_dim == 1 else 1


def check_sharding(config: ModelConfig, par: Parallelism, dims: Dims, where: str = "$.parallel") -> None:
    """The checks that need the whole mesh's sizes: QLoRA's (`check_nf4`), and experts' biases
    split by tp (gpt-oss), whose FSDP2 shards then take the experts dim (`fsdp_dim`): not split by
    ep as well, and evenly over the replicas."""
    if nf4_base(par):
        check_nf4(config, par, dims, where)
    biased = config.moe is not None and config.mlp_bias
    if not (biased and dims.tp > 1 and fsdp_wrapped(par, dims)):
        return
    if dims.ep > 1 and dims.experts_replicas > 1:
        raise UserError(
            "experts with biases under tp x ep train with dp = ep and cp 1 (their biases' one free dim is ep's)",
            f"{where}.ep",
        )
    if dims.ep == 1 and config.moe.num_experts % dims.replicas:
        raise UserError(
            f"experts' biases under tp are sharded over dp x cp {dims.replicas} by expert, which "
            f"must divide the {config.moe.num_experts} experts",
            where,
        )


_BLOCK = re.compile(r"^(layers\.\d+)\.")


def fsdp_unit(name: str, dims: Dims) -> str:
    """The module FSDP2 wraps a parameter (checkpoint name) in, by its name in the stage: its
    block ("layers.3"), its block's experts under expert parallel ("layers.3.mlp.experts", sharded
    over edp), or the stage itself (""): the embedding, the final norm and the head."""
    m = _BLOCK.match(name)
    if m is None:
        return ""
    if dims.ep > 1 and is_experts(name):
        return f"{m.group(1)}.mlp.experts"
    return m.group(1)


def check_nf4(config: ModelConfig, par: Parallelism, dims: Dims, where: str = "$.parallel") -> None:
    """The layouts QLoRA covers: one process, dp with FSDP2 and pp (not tp, cp or ep, nor compiled
    blocks); each NF4 weight holds whole blocks of NF4_BLOCK values, and each of its FSDP2 shards
    (whole rows) whole scaler blocks (`config.nf4_scaler_block`: of NF4_SCALER_BLOCK blocks, fewer
    for small projections)."""
    spec = par.spec
    for name, size in (("tp", spec.tp), ("cp", spec.cp), ("ep", spec.ep)):
        if size > 1:
            raise UserError(
                f"QLoRA (base_dtype nf4) covers dp (FSDP2) and pp; {name} must be 1", f"{where}.{name}"
            )
    if dims.replicas > 1 and spec.dp_mode != "fsdp":
        raise UserError(
            "QLoRA (base_dtype nf4) shards its base with FSDP2 (dp_mode fsdp)", f"{where}.dp_mode"
        )
    if par.compile:
        raise UserError(
            "QLoRA (base_dtype nf4) runs eager: set compile to false or auto", _field(where, "compile")
        )
    shards = dims.replicas if fsdp_wrapped(par, dims) else 1
    for name, shape in model_tensors(config).items():
        if is_block_projection(name):
            _check_nf4_tensor(name, shape, shards, where)


def _check_nf4_tensor(name: str, shape: tuple[int, ...], shards: int, where: str) -> None:
    """A projection QLoRA stores in NF4: whole blocks, and over dp whole scaler blocks a shard."""
    numel = shape[0] * shape[1]
    if numel % NF4_BLOCK:
        raise UserError(
            f"QLoRA stores {name} ({shape[0]} x {shape[1]}) in NF4 blocks of {NF4_BLOCK} values, "
            "which its size does not divide into",
            where,
        )
    values = NF4_BLOCK * nf4_scaler_block(numel)
    if shards > 1 and (shape[0] % shards or numel // shards % values):
        raise UserError(
            f"QLoRA's NF4 {name} ({shape[0]} x {shape[1]}) has scales quantized in blocks of {values} "
            f"values, which its FSDP2 shards over dp {shards} (whole rows) must hold whole",
            where,
        )
