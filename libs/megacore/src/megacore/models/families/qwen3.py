"""Qwen 3 dense: Qwen 2's layout without the q/k/v biases, an RMSNorm over each q and k head before
RoPE (`qk_norm`), and an explicit head_dim (128 when a config.json has none, as Qwen3Config).

HF layout (Qwen3ForCausalLM): Llama's tensor names plus model.layers.N.self_attn.{q,k}_norm.weight,
each of shape (head_dim,). `attention_bias` (false in published configs) puts a bias on all four
attention projections; the sliding-window keys read as Qwen 2's (`qwen2.sliding_window`).
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama, qwen2
from megacore.models.families.common import HFConfig, TensorMap, build_config

MODEL_TYPES = ("qwen3",)
ARCHITECTURE = "Qwen3ForCausalLM"


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    bias = c.bool("attention_bias", False)
    return build_config(
        where,
        family="qwen3",
        **qwen2.common_fields(c),
        head_dim=c.int("head_dim", 128),
        qk_norm=True,
        attn_bias=bias,
        attn_out_bias=bias,
        mlp_bias=False,
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if not config.qk_norm or config.attn_bias != config.attn_out_bias:
        raise UserError("Qwen 3 has q/k norms and one attention bias switch; this config differs", "config")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        **qwen2.common_hf(config, "Qwen 3"),
        "head_dim": config.head_dim,
        "attention_bias": config.attn_bias,
    }


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
