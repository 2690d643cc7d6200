"""Artifacts: manifests, atomic writing, verification and the tensor layout algebra.

The layout algebra needs torch; it is imported on first use so that tools which only read
manifests (a dry run, the tokenizer) start without paying for it.
"""

import importlib

from megacore.artifacts.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointManifest,
    Manifest,
    ModelConfig,
    Piece,
    RunManifest,
    TensorEntry,
    TokensManifest,
    decode_manifest,
    encode_manifest,
    json_schemas,
    new_header_fields,
)
from megacore.artifacts.reader import confined_path, open_artifact, parent_of
from megacore.artifacts.writer import ArtifactWriter, sha256_file, write_artifact

_LAZY = {
    "SafetensorsStreamWriter",
    "TensorReader",
    "chunk_split",
    "dtype_name",
    "even_split",
    "intersect",
    "piece_entry",
}

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ArtifactWriter",
    "CheckpointManifest",
    "Manifest",
    "ModelConfig",
    "Piece",
    "RunManifest",
    "SafetensorsStreamWriter",
    "TensorEntry",
    "TensorReader",
    "TokensManifest",
    "chunk_split",
    "confined_path",
    "decode_manifest",
    "dtype_name",
    "encode_manifest",
    "even_split",
    "intersect",
    "json_schemas",
    "new_header_fields",
    "open_artifact",
    "parent_of",
    "piece_entry",
    "sha256_file",
    "write_artifact",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("megacore.artifacts.layout"), name)
    raise AttributeError(f"module 'megacore.artifacts' has no attribute {name!r}")
