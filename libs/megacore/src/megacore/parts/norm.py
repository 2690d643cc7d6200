"""The norm part: RMSNorm, LayerNorm or Gemma's (1 + w) RMSNorm (`config.norm`), hidden-wide.
Its tensors ("<name>.weight", LayerNorm's "<name>.bias" with its `bias`), replicated over tp
(every rank normalises whole hidden states), and what it saves for backward (the planner's
terms; the block counts how many norms it runs, `parts.block`)."""

from __future__ import annotations

from megacore.config import ModelConfig
from megacore.config_parts import LayerNormSpec, PlusOneRMSNormSpec, RMSNormSpec
from megacore.parts.compute import Shapes


def tensors(out: Shapes, config: ModelConfig, name: str) -> None:
    out[f"{name}.weight"] = (config.hidden_size,)
    if isinstance(config.norm, LayerNormSpec) and config.norm.bias:
        out[f"{name}.bias"] = (config.hidden_size,)


def tp_dims(names: tuple[str, ...]) -> dict[str, int | None]:
    """The norms `names` (layer-relative, as "attn_norm"): replicated over tp."""
    return {f"{n}.{kind}": None for n in names for kind in ("weight", "bias")}


def stat_bytes(config: ModelConfig) -> int:
    """Bytes per token of a norm's fp32 statistics: RMSNorm's rstd; LayerNorm's mean and rstd."""
    return 8 if isinstance(config.norm, LayerNormSpec) else 4


def plain_extra(config: ModelConfig, saved: int, c: int) -> int:
    """Bytes a norm running as plain ops (on a sequence shard) saves beyond its input of `saved`
    bytes: nn.RMSNorm its normalised input (measured); Gemma's (1 + w) RMSNorm its fp32 normalised
    input and, in a 2-byte dtype, an fp32 copy of the input in the input's place."""
    if isinstance(config.norm, RMSNormSpec):
        return saved
    if isinstance(config.norm, PlusOneRMSNormSpec):
        return saved * 4 // c + saved * (4 - c) // c
    return 0
