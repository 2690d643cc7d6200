"""megacore.models: one decoder with architecture switches and the HF name maps of its families.

`Decoder(config)` is a plain nn.Module (no parallel code, no file I/O); see decoder.py for the
naming contract.
"""

from megacore.models.attention import causal_attention
from megacore.models.decoder import Attention, Block, Decoder
from megacore.models.families import FAMILIES, TensorMap, family_of
from megacore.models.hf import (
    check_maps,
    config_from_hf,
    config_to_hf,
    export_tensors,
    hf_shapes,
    hf_state_dict_to_ours,
    import_tensors,
    tensor_maps,
)
from megacore.models.rope import apply_rope, rope_tables

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
