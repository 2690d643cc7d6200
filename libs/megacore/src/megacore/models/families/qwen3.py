"""Qwen 3 dense: Qwen 2's layout without the q/k/v biases, an RMSNorm over each q and k head before
RoPE (`qk_norm`), and an explicit head_dim (128 when a config.json has none, as Qwen3Config).

HF layout (Qwen3ForCausalLM): Llama's tensor names plus model.layers.N.self_attn.{q,k}_norm.weight,
each of shape (head_dim,). `attention_bias` (false in published configs) puts a bias on all four
attention projections; the sliding-window keys read as Qwen 2's (`qwen2.sliding_window`).

Qwen 3 MoE (Qwen3MoeForCausalLM, model_type qwen3_moe) is the same decoder whose every MLP is a
mixture of experts (`models/moe.py`): `num_experts` SwiGLU experts of `moe_intermediate_size`,
`num_experts_per_tok` chosen per token, renormalised when `norm_topk_prob` is set (Qwen3-30B-A3B
and 235B-A22B set it; transformers' default does not): `renormalize_top_k`. Per layer the
checkpoint holds `mlp.gate` (the router) and `mlp.experts.<j>.{gate,up,down}_proj`, stacked per
projection in ours (`llama.moe_experts`). Dense layers among the sparse ones (`mlp_only_layers`,
`decoder_sparse_step` > 1) are dense SwiGLUs `intermediate_size` wide (`qwen2.moe_fields`).
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama, qwen2
from megacore.models.families.hf_config import HFConfig, build_config
from megacore.models.families.tensor_map import TensorMap

MODEL_TYPES = ("qwen3", "qwen3_moe")
ARCHITECTURE = "Qwen3ForCausalLM"
MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
NAME = "Qwen 3"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Qwen 3 (or Qwen 3 MoE) config.json can
# set to other than their defaults (`families.check_expressible` refuses the rest); qk_norm is
# always set.
SWITCHES = (
    "head_dim",
    "sliding_window",
    "attention.bias",
    "attention.out_bias",
    "attention.qk_norm",
    *qwen2.MOE_SWITCHES,
)


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    bias = c.bool("attention_bias", False)
    moe = hf.get("model_type") == "qwen3_moe"
    fields = qwen2.common_fields(c) | (qwen2.moe_fields(c, 768, 128, 8) if moe else {})
    return build_config(
        where,
        family="qwen3",
        **fields,
        head_dim=c.int("head_dim", 128),
        attention={"type": "standard", "qk_norm": True, "bias": bias, "out_bias": bias},
        mlp_bias=False,
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if not config.attention.qk_norm or config.attention.bias != config.attention.out_bias:
        raise UserError("Qwen 3 has q/k norms and one attention bias switch; this config differs", "config")
    moe = config.moe is not None
    out = {
        "architectures": [MOE_ARCHITECTURE if moe else ARCHITECTURE],
        "model_type": "qwen3_moe" if moe else "qwen3",
        **qwen2.common_hf(config),
        "head_dim": config.head_dim,
        "attention_bias": config.attention.bias,
    }
    if not moe:
        return out
    return out | qwen2.moe_to_hf(config)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
