"""Model families: the Hugging Face config / tensor-name maps, both directions."""

from __future__ import annotations

from types import ModuleType

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import falcon, gemma3, llama, mistral, mixtral, qwen2, qwen3
from megacore.models.families.common import TensorMap

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": mistral,
    "falcon": falcon,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "mixtral": mixtral,
}


def family_of(config: ModelConfig) -> ModuleType:
    return FAMILIES[config.family]


def family_for_model_type(model_type: object, where: str) -> ModuleType:
    for fam in FAMILIES.values():
        if model_type in fam.MODEL_TYPES:
            return fam
    known = sorted(t for fam in FAMILIES.values() for t in fam.MODEL_TYPES)
    raise UserError(
        f"$.model_type: {model_type!r} is not a supported architecture (supported: {known})", where
    )


__all__ = ["FAMILIES", "TensorMap", "family_for_model_type", "family_of"]
