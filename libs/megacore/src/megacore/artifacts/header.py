"""The fields every manifest shares (docs/architecture.md, "The artifact contract"): the format
version, the header (`Header`: producer, parents, files, recipe), the typed path fields and the
float dtypes' two spellings. Every path field is typed by what it points at (`x-path` in the
schemas), so that one function, `megacore.artifacts.reader.check_paths`, finds and checks all of
them:
- `file`: a file of this artifact: relative, confined to its directory, listed in `files`;
- `prefix`: `<prefix>.bin` and `<prefix>.idx` of this artifact, each as a `file`;
- `ref`: a path outside the artifact (a run manifest's inputs and outputs), resolved against the
  manifest's directory, never the working directory;
- `record`: provenance (a parent's or an input's path as given); recorded, never opened.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

from megacore.config import Struct
from megacore.errors import UserError

FORMAT_VERSION = 5  # 2: a mixture of experts' training settings moved to the run; 3: the config's attention and MLP parts; 4: its norm, RoPE and block parts, attention's switches in its part; 5: partial RoPE, the output gate, linear attention
MANIFEST_NAME = "manifest.json"

Kind = Literal["tokens", "checkpoint", "run", "hf"]
DType = Literal["float32", "bfloat16", "float16", "int64", "int32", "uint16", "uint8"]
# The float dtypes' two spellings, the one alias table: a tool's --dtype and a run manifest's
# `precision` take either, normalised by `float_dtype` / `precision_name`; what is written stays
# canonical (a tensor's dtype long, a run's precision short), so older readers read it.
FLOAT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FloatName = Literal[(*FLOAT_DTYPES, *FLOAT_DTYPES.values())]
_LONG_NAMES = {
    **{long: long for long in FLOAT_DTYPES},
    **{short: long for long, short in FLOAT_DTYPES.items()},
}


def float_dtype(name: str, where: str = "--dtype") -> str:
    """A float dtype in either spelling (bf16 or bfloat16) as its long name (bfloat16)."""
    if name not in _LONG_NAMES:
        raise UserError(f"expected one of {', '.join(_LONG_NAMES)}, got {name!r}", where)
    return _LONG_NAMES[name]


def precision_name(name: str, where: str = "$.precision") -> str:
    """A float dtype in either spelling as its short name (bf16), as a run's `precision` is held."""
    return FLOAT_DTYPES[float_dtype(name, where)]


def _path(kind: str) -> object:
    return msgspec.Meta(extra_json_schema={"x-path": kind})


FilePath = Annotated[str, _path("file")]
Prefix = Annotated[str, _path("prefix")]
Ref = Annotated[str, _path("ref")]
Record = Annotated[str, _path("record")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
LoRATarget = Annotated[str, msgspec.Meta(min_length=1)]


# --- common header -------------------------------------------------------------------------------


class Producer(Struct):
    name: str
    version: str


class Parent(Struct):
    """An input artifact: path as given on the command line, its kind and its manifest's sha256."""

    path: Record
    kind: Kind
    manifest_sha256: str


class FileEntry(Struct):
    """A data file of the artifact; `path` is relative and confined to the artifact directory."""

    path: FilePath
    size: NonNegative
    sha256: str


class Header(Struct, tag_field="kind", kw_only=True):
    """Fields every kind has. `recipe_sha256` hashes what decides the artifact's content (its
    inputs' identities and the settings): a rerun with the same recipe reuses the artifact."""

    format_version: int
    producer: Producer | None = None
    created_at: str | None = None
    parents: list[Parent] = []
    files: list[FileEntry] = []
    recipe_sha256: str | None = None


def new_header_fields(producer: str, version: str) -> dict:
    """The header values a writer fills in: producer, creation time and the current format."""
    return {
        "format_version": FORMAT_VERSION,
        "producer": Producer(name=producer, version=version),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
