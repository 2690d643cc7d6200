"""megacore.models: one decoder with architecture switches and the HF name maps of its families.

`Decoder(config)` is a plain nn.Module (no parallel code, no file I/O); see decoder.py for the
naming contract. A family's config.json is read and written without torch (`families`: a dry run
plans a model from its config.json alone); the names that need torch are imported on first use.
"""

import importlib

from megacore.models.families import FAMILIES, TensorMap, config_from_hf, config_to_hf, family_of

# The torch side, by module: imported when first asked for.
_LAZY = {
    "causal_attention": "attention",
    "Attention": "decoder",
    "Block": "decoder",
    "Decoder": "decoder",
    "check_maps": "hf",
    "export_tensors": "hf",
    "hf_shapes": "hf",
    "hf_state_dict_to_ours": "hf",
    "import_tensors": "hf",
    "tensor_maps": "hf",
    "apply_rope": "rope",
    "rope_tables": "rope",
}

__all__ = [
    "FAMILIES",
    "Attention",
    "Block",
    "Decoder",
    "TensorMap",
    "apply_rope",
    "causal_attention",
    "check_maps",
    "config_from_hf",
    "config_to_hf",
    "export_tensors",
    "family_of",
    "hf_shapes",
    "hf_state_dict_to_ours",
    "import_tensors",
    "rope_tables",
    "tensor_maps",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"megacore.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megacore.models' has no attribute {name!r}")
