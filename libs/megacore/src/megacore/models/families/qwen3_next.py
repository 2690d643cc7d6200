"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen 3.5's decoder before it (the same
layers: Gated DeltaNet linear attention in three of every four, gated full attention with q/k
norms and RoPE over a quarter of each head, zero-centred norms: `qwen3_5.hybrid_fields`), its
MLPs a mixture in every layer (`num_experts` experts of `moe_intermediate_size`,
`num_experts_per_tok` by a softmax router renormalised (`norm_topk_prob`), beside a shared expert
gated by a sigmoid) but the dense ones `mlp_only_layers` and `decoder_sparse_step` name, as Qwen 3
MoE's (`qwen2.moe_fields`); `num_experts` 0: dense SwiGLUs throughout.

HF layout: Qwen 3.5's (`qwen3_5`), but a linear layer's input projections: `in_proj_qkvz` holds,
key head by key head, its q rows, its k rows, then the v rows and the z rows of the value heads
that share it; `in_proj_ba` likewise each key head's value heads' b rows, then their a rows
(`per_head` with their widths splits them into ours)."""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import qwen2, qwen3_5
from megacore.models.families.hf_config import HFConfig, build_config
from megacore.models.families.tensor_map import TensorMap, per_head

MODEL_TYPES = ("qwen3_next",)
ARCHITECTURE = "Qwen3NextForCausalLM"
NAME = "Qwen3-Next"
SWITCHES = (
    *qwen3_5.SWITCHES,
    "mlp.router.renormalize_top_k",
    "mlp.dense_layers",
    "mlp.dense_ffn_hidden_size",
)
# Qwen3NextConfig's sizes where they differ from Qwen 3.5's
DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_key_value_heads": 2}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a Qwen3-Next config.json (defaults as transformers' Qwen3NextConfig)."""
    c = HFConfig(hf, where)
    if c.int("num_experts", 512) == 0:
        mlp: dict[str, Any] = {"ffn_hidden_size": c.int("intermediate_size", 5632)}
    else:
        mlp = qwen2.moe_fields(c, 512, 512, 10, layers=DEFAULTS["num_hidden_layers"], renormalize=True)
        mlp["mlp"]["shared_expert"] = {"size": c.int("shared_expert_intermediate_size", 512), "gate": True}
    return build_config(where, family="qwen3_next", **qwen3_5.hybrid_fields(c, DEFAULTS), **mlp)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    out = qwen3_5.hybrid_to_hf(config, NAME) | {"architectures": [ARCHITECTURE], "model_type": "qwen3_next"}
    moe = config.moe
    if moe is None:
        return out | {"intermediate_size": config.ffn_hidden_size, "num_experts": 0}
    if not (moe.shared_expert and moe.shared_expert.gate):
        raise UserError("Qwen3-Next's mixtures have a gated shared expert; this config differs", "config")
    return out | qwen2.moe_to_hf(config) | {"shared_expert_intermediate_size": moe.shared_expert.size}


def _inputs(config: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """A linear layer's input projections, interleaved by key head (the module docstring)."""
    spec = config.linear_attention
    shared = spec.value_heads // spec.key_heads  # value heads a key head serves
    dk, dv = spec.key_head_dim, spec.value_head_dim
    return [
        per_head(f"{hf}.in_proj_qkvz.weight", tuple(f"{ours}.{s}_proj.weight" for s in "qkvz"), spec.key_heads,
                 (dk, dk, shared * dv, shared * dv)),
        per_head(f"{hf}.in_proj_ba.weight", (f"{ours}.b_proj.weight", f"{ours}.a_proj.weight"), spec.key_heads,
                 (shared, shared)),
    ]  # fmt: skip


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return qwen3_5.tensor_maps(config, _inputs)


extra_tensors = qwen3_5.extra_tensors
