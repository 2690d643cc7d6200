"""Mistral: the Llama layout plus a sliding attention window (null in v0.2+ configs).

Same HF tensor names as Llama (MistralForCausalLM); transformers' MistralConfig defaults
sliding_window to 4096 when the key is absent, and so do we.
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama
from megacore.models.families.common import TensorMap

MODEL_TYPES = ("mistral",)
ARCHITECTURE = "MistralForCausalLM"


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    return llama.config_from_hf(hf, where, family="mistral")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if config.attn_bias or config.attn_out_bias or config.mlp_bias:
        raise UserError("Mistral configs have no bias switches; this config uses biases", "config")
    out = llama.config_to_hf(config)
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    out.update(architectures=[ARCHITECTURE], model_type="mistral", sliding_window=config.sliding_window)
    return out


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
