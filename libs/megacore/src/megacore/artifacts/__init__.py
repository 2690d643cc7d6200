"""Artifacts: manifests (manifest.py), opening and path checks (reader.py), the output policy and
atomic writing (output.py, writer.py), and the tensor layout algebra (pieces.py, tensors.py).

`tensors` needs torch; it is imported on first use so that tools which only read manifests (a dry
run, the tokenizer) start without paying for it.
"""

import importlib

from megacore.artifacts.codec import decode_manifest, encode_manifest, json_schemas
from megacore.artifacts.header import FORMAT_VERSION, MANIFEST_NAME, new_header_fields
from megacore.artifacts.manifest import (
    CheckpointManifest,
    HFManifest,
    Manifest,
    Piece,
    TensorEntry,
    TokensManifest,
    kind_of,
)
from megacore.artifacts.output import prepare_output, recipe_sha256, reusable, write_artifact
from megacore.artifacts.pieces import Box, chunk_split, even_split, intersect, piece_entry, whole
from megacore.artifacts.reader import (
    check_model_tensors,
    confined_path,
    open_artifact,
    parent_of,
    resolve_ref,
)
from megacore.artifacts.run_spec import RunManifest
from megacore.artifacts.writer import ArtifactWriter, sha256_file

_LAZY = {"SafetensorsStreamWriter", "TensorReader", "TORCH_DTYPES", "dtype_name"}

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TORCH_DTYPES",
    "ArtifactWriter",
    "Box",
    "CheckpointManifest",
    "HFManifest",
    "Manifest",
    "Piece",
    "RunManifest",
    "SafetensorsStreamWriter",
    "TensorEntry",
    "TensorReader",
    "TokensManifest",
    "check_model_tensors",
    "chunk_split",
    "confined_path",
    "decode_manifest",
    "dtype_name",
    "encode_manifest",
    "even_split",
    "intersect",
    "json_schemas",
    "kind_of",
    "new_header_fields",
    "open_artifact",
    "parent_of",
    "piece_entry",
    "prepare_output",
    "recipe_sha256",
    "resolve_ref",
    "reusable",
    "sha256_file",
    "whole",
    "write_artifact",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("megacore.artifacts.tensors"), name)
    raise AttributeError(f"module 'megacore.artifacts' has no attribute {name!r}")
