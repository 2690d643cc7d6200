"""Mistral: the Llama layout plus a sliding attention window (null in v0.2+ configs), no biases.

Same HF tensor names as Llama (MistralForCausalLM) and Llama's config keys but its bias switches
(`llama.lineage_fields`, `llama.lineage_to_hf`): MistralConfig has none, and transformers builds
every projection without a bias whatever a config.json says. transformers' MistralConfig defaults
sliding_window to 4096 when the key is absent, and so do we.
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama
from megacore.models.families.hf_config import HFConfig, build_config
from megacore.models.families.tensor_map import TensorMap

MODEL_TYPES = ("mistral",)
ARCHITECTURE = "MistralForCausalLM"
NAME = "Mistral"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Mistral config.json can set to other
# than their defaults (`families.check_expressible` refuses the rest).
SWITCHES = ("head_dim", "sliding_window")


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    return build_config(
        where, family="mistral", **llama.lineage_fields(c), sliding_window=sliding_window(c, 4096)
    )


def sliding_window(c: HFConfig, default: int | None) -> int | None:
    """config.json's `sliding_window` (`default` when the key is absent: MistralConfig's 4096,
    MixtralConfig's none)."""
    window = c.data.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise UserError(f"$.sliding_window: expected an integer or null, got {window!r}", c.where)
    return window


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**llama.lineage_to_hf(config, ARCHITECTURE, "mistral"), "sliding_window": config.sliding_window}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
