"""megacore.models: one decoder with architecture switches, family presets and the HF name maps.

`Decoder(config)` is a plain nn.Module (no parallel code); see decoder.py for the naming contract.
"""

from megacore.models.attention import causal_attention
from megacore.models.decoder import Attention, Block, Decoder, padded_vocab
from megacore.models.families import FAMILIES, PRESETS, TensorMap, family_of, preset
from megacore.models.hf import (
    DEFAULT_PAD_MULTIPLE,
    check_maps,
    config_from_hf,
    config_to_hf,
    decoder_shapes,
    export_tensors,
    hf_shapes,
    hf_state_dict_to_ours,
    import_tensors,
    load_checkpoint_state,
    load_decoder,
    padded_vocab_size,
    tensor_maps,
    write_hf_dir,
)
from megacore.models.rope import apply_rope, rope_tables

__all__ = [
    "DEFAULT_PAD_MULTIPLE",
    "FAMILIES",
    "PRESETS",
    "Attention",
    "Block",
    "Decoder",
    "TensorMap",
    "apply_rope",
    "causal_attention",
    "check_maps",
    "config_from_hf",
    "config_to_hf",
    "decoder_shapes",
    "export_tensors",
    "family_of",
    "hf_shapes",
    "hf_state_dict_to_ours",
    "import_tensors",
    "load_checkpoint_state",
    "load_decoder",
    "padded_vocab",
    "padded_vocab_size",
    "preset",
    "rope_tables",
    "tensor_maps",
    "write_hf_dir",
]
