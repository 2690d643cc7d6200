"""Manifest bytes <-> structs (`megacore.artifacts.manifest` has the structs): strict decoding, with
one-line errors naming the field (`$.parallel.tp: expected int, got str`) and, for a value outside
an enum, the values it takes; earlier format versions upgraded first (`upgrade.py`); stable encoding; the JSON Schemas `schemas/` holds (`make schemas`).
"""

from __future__ import annotations

import json
import re

import msgspec

from megacore.artifacts.header import FORMAT_VERSION, Kind
from megacore.artifacts.manifest import MANIFEST_TYPES, Manifest
from megacore.artifacts.upgrade import upgrade
from megacore.config import ModelConfig
from megacore.errors import UserError


class _Peek(msgspec.Struct):
    kind: str | None = None
    format_version: int | None = None


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)


def _validation_message(e: msgspec.ValidationError, root: type | None = None) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a.b`" as "$.a.b: expected int, got str"; a
    value outside an enum of `root`'s is followed by the values it takes."""
    m = _AT.match(str(e))
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or "$"
    msg = msg.replace("`", "")
    allowed = _enum_values(root, path) if root is not None and msg.startswith("Invalid enum value") else None
    tail = f"; choose one of {', '.join(map(json.dumps, allowed))}" if allowed else ""
    return f"{path}: {msg[:1].lower()}{msg[1:]}{tail}"


_STEP = re.compile(r"\.(\w+)|\[\d+\]")


def _enum_values(root: type, path: str) -> list | None:
    """The values the Literal at `path` (`$.parallel.schedule`, `$.data.sources[0].x`) of the
    struct type `root` takes, or None when the path does not lead to one."""
    info = msgspec.inspect.type_info(root)
    for step in _STEP.finditer(path[1:]):
        info = _inner(info, step.group(1))
        if info is None:
            return None
    literal = _unwrap(info, msgspec.inspect.LiteralType)
    if literal is None:
        return None
    flags = [True, False] if _unwrap(info, msgspec.inspect.BoolType) is not None else []
    return [*flags, *literal.values]


def _unwrap(info, kind: type):
    """`info` itself, or its member of type `kind` when it is a union (an optional field)."""
    if isinstance(info, kind):
        return info
    if isinstance(info, msgspec.inspect.UnionType):
        return next((t for t in info.types if isinstance(t, kind)), None)
    return None


def _inner(info, field: str | None):
    """The type of a struct's `field` (or, with None, of a list's items) within `info`."""
    if field is None:
        items = _unwrap(info, msgspec.inspect.ListType)
        return items.item_type if items is not None else None
    struct = _unwrap(info, msgspec.inspect.StructType)
    if struct is None:
        return None
    return next((f.type for f in struct.fields if f.encode_name == field), None)


def decode_manifest(data: bytes, where: str, kind: Kind | None = None) -> Manifest:
    """Strictly decode manifest bytes. Raises UserError naming `where` and the field path."""
    try:
        peek = msgspec.json.decode(data, type=_Peek)
    except msgspec.ValidationError as e:
        raise UserError(_validation_message(e), where) from None
    except msgspec.DecodeError as e:
        raise UserError(f"not valid JSON ({e})", where) from None
    if peek.kind not in MANIFEST_TYPES:
        raise UserError(f"$.kind: expected one of {sorted(MANIFEST_TYPES)}, got {peek.kind!r}", where)
    if kind is not None and peek.kind != kind:
        raise UserError(f"expected a {kind} artifact, found kind {peek.kind!r}", where)
    if peek.format_version is None:
        raise UserError("$.format_version: missing required field", where)
    if peek.format_version > FORMAT_VERSION:
        raise UserError(
            f"$.format_version: {peek.format_version} is newer than this megacore supports "
            f"({FORMAT_VERSION}); upgrade the tools",
            where,
        )
    if peek.format_version < 1:
        raise UserError(f"$.format_version: {peek.format_version} is not a valid version", where)
    if peek.format_version < FORMAT_VERSION:  # an earlier release's artifact, read as today's
        data = msgspec.json.encode(upgrade(msgspec.json.decode(data), peek.format_version))
    try:
        return msgspec.json.decode(data, type=MANIFEST_TYPES[peek.kind])
    except msgspec.ValidationError as e:
        raise UserError(_model_field(_validation_message(e, MANIFEST_TYPES[peek.kind])), where) from None


_UNKNOWN_MODEL_FIELD = re.compile(r"\$\.model: object contains unknown field (\w+)")


def _model_field(message: str) -> str:
    """A run manifest's `model` given a field of the model config (`rope` beside `init`)
    is refused naming it, with what can be set there instead; other messages are returned as they are."""
    m = _UNKNOWN_MODEL_FIELD.fullmatch(message)
    if m is None or m.group(1) not in ModelConfig.__struct_fields__:
        return message
    name = m.group(1)
    return (
        f"$.model.{name}: a run from `init` keeps the checkpoint's {name}; beside `init` only "
        "max_seq_len, rope_scaling and the router loss coefficients can be set (a new model's whole config goes in $.model.config)"
    )


def encode_manifest(manifest: Manifest) -> bytes:
    """Stable, human-readable JSON (sorted keys inside free-form maps, 2-space indent)."""
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"


def json_schemas() -> dict[str, dict]:
    """JSON Schema of each manifest kind, keyed by kind: what `schemas/` holds."""
    return {kind: msgspec.json.schema(t) for kind, t in MANIFEST_TYPES.items()}


def write_schemas(directory: str) -> list[str]:
    """Write `<kind>.schema.json` for every kind into `directory` (what `make schemas` runs)."""
    import json
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, schema in json_schemas().items():
        path = out / f"{kind}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(str(path))
    return written
