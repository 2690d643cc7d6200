"""Model families: presets and the Hugging Face config / tensor-name maps, both directions."""

from __future__ import annotations

from types import ModuleType

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import falcon, llama, mistral
from megacore.models.families.common import TensorMap

FAMILIES: dict[str, ModuleType] = {"llama": llama, "mistral": mistral, "falcon": falcon}
PRESETS: dict[str, ModelConfig] = {
    name: cfg for fam in FAMILIES.values() for name, cfg in fam.PRESETS.items()
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


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


__all__ = ["FAMILIES", "PRESETS", "TensorMap", "family_for_model_type", "family_of", "preset"]
