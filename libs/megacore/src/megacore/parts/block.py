"""The block part: how a decoder layer arranges its norms around its attention and its MLP.
Sequential (a norm before each; Gemma's sandwich adds one after each, `sandwich_norm`) or parallel
(Falcon: attention and MLP read the same input, through one norm or two, `norms`): `config.block`.
Its norms' tensors, in the layer's state-dict order around the attention's and the MLP's, are
replicated over tp; `norm_saves` is what they save for backward."""

from __future__ import annotations

import math
from types import ModuleType

from megacore.config import ModelConfig
from megacore.parts import norm
from megacore.parts.compute import Compute, Shapes

NORMS = ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")
_TP_DIMS = norm.tp_dims(NORMS)


def tensors(out: Shapes, config: ModelConfig, layer: int, attention: ModuleType, mlp: ModuleType) -> None:
    """Layer `layer`'s tensors: its norms around its `attention` and `mlp` parts' (modules of
    `megacore.parts`)."""
    at = f"layers.{layer}"
    norm.tensors(out, config, f"{at}.attn_norm")
    attention.tensors(out, config, f"{at}.attn")
    if config.block.sandwich_norm:
        norm.tensors(out, config, f"{at}.attn_post_norm")
    if config.block.mlp_norm:
        norm.tensors(out, config, f"{at}.mlp_norm")
    mlp.tensors(out, config, f"{at}.mlp", layer)
    if config.block.sandwich_norm:
        norm.tensors(out, config, f"{at}.mlp_post_norm")


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    return _TP_DIMS


def norm_saves(config: ModelConfig, comp: Compute, tokens: int) -> int:
    """What a block's hidden norms save: their inputs and fp32 statistics, the outputs the
    projections read, and where they run as plain ops (`build_rules.fast_paths`) what those save
    besides."""
    c, sp, h = comp.c, comp.sp, config.hidden_size
    residual = math.ceil(tokens / sp) * h * c
    norm_in = 1 if config.block.parallel else 2  # a parallel block's norms share their input
    if config.block.sandwich_norm:  # the attention's and the MLP's outputs, normed before the residual add
        norm_in += 2
    # Norm outputs the projections read; with sequence parallel each of attention and MLP gathers its own.
    norm_out = 1 if not config.block.mlp_norm and sp == 1 else 2
    stats = math.ceil(tokens / sp) * norm.stat_bytes(config)
    total = norm_in * (residual + stats) + norm_out * tokens * h * c
    if not comp.fast["norms"]:  # measured: nn.RMSNorm on a sequence shard saves its normalised input
        # too, and a block one more shard besides
        total += norm_in * norm.plain_extra(config, residual, c) + residual
    return total
