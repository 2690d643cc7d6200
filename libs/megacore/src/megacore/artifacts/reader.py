"""Opening artifacts: manifest decoding, path checks and checksum verification.

Every tool opens its inputs through `open_artifact`; the errors are UserErrors (exit 2) that name
the artifact, the field path and the file. `check_paths` is the one place a path from a manifest
is checked: it finds every field typed as a path (manifest.py's `FilePath`, `Prefix`, `Ref`,
`Record`) by walking the manifest with its type, so a path field added later is checked too.
`check_file` is the one place a data file is checked against its `$.files` entry (a mismatch is
`DamagedFile`): `open_artifact` calls it for every file, and tensors.py's `TensorReader` for each
file it opens (its size then; its sha256, hashed while the file is read, goes to `check_sha256`,
the comparison `check_file` makes too). `check_model_tensors`: a checkpoint holds every tensor its
config implies, with that shape.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Literal, overload

import msgspec
import msgspec.inspect as mi

from megacore.artifacts.codec import decode_manifest
from megacore.artifacts.header import MANIFEST_NAME, FileEntry, Kind, Parent
from megacore.artifacts.manifest import (
    BaseModel,
    CheckpointManifest,
    HFManifest,
    HFSource,
    Manifest,
    Piece,
    TokensManifest,
    kind_of,
)
from megacore.artifacts.pieces import check_pieces
from megacore.artifacts.run_spec import RunManifest
from megacore.artifacts.writer import sha256_bytes, sha256_file
from megacore.config import LORA_A, OPTIM_PREFIX
from megacore.errors import DamagedFile, UserError
from megacore.parts import adapter_tensors, model_tensors

Verify = Literal["sha256", "size", "none"]
PREFIX_SUFFIXES = (".bin", ".idx")


def confined_path(root: Path, relpath: str, where: str) -> Path:
    """Resolve `relpath` inside `root`, refusing absolute paths, `..` and symlinks that leave it."""
    p = PurePosixPath(relpath)
    if p.is_absolute() or relpath.startswith(("/", "\\")) or (len(relpath) > 1 and relpath[1] == ":"):
        raise UserError(f"file path {relpath!r} is absolute; artifact paths must be relative", where)
    if ".." in p.parts or relpath in ("", "."):
        raise UserError(f"file path {relpath!r} leaves the artifact directory", where)
    full = root / Path(*p.parts)
    real_root = os.path.realpath(root)
    real = os.path.realpath(full)
    if os.path.commonpath([real_root, real]) != real_root:
        raise UserError(f"file path {relpath!r} resolves outside the artifact (symlink)", where)
    return full


def resolve_ref(base: Path, value: str) -> Path:
    """A `ref` path of a manifest (e.g. a run manifest's inputs): absolute, or relative to `base`, the
    manifest's directory, whatever the working directory is."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(base) / path


# --- path fields ---------------------------------------------------------------------------------


def _path_kind(t: mi.Type) -> str | None:
    if isinstance(t, mi.Metadata):
        return (t.extra_json_schema or {}).get("x-path")
    return None


_HOLDS_PATHS: dict[int, bool] = {}  # by id: type infos are not hashable, and live in _type_info's cache


def _may_hold_paths(t: mi.Type) -> bool:
    """Whether values of type `t` can contain a path field (subtrees without any are skipped)."""
    known = _HOLDS_PATHS.get(id(t))
    if known is not None:
        return known
    if _path_kind(t) is not None:
        found = True
    elif isinstance(t, mi.Metadata):
        found = _may_hold_paths(t.type)
    elif isinstance(t, mi.StructType):
        found = any(_may_hold_paths(f.type) for f in t.fields)
    elif isinstance(t, mi.ListType):
        found = _may_hold_paths(t.item_type)
    elif isinstance(t, mi.DictType):
        found = _may_hold_paths(t.value_type)
    elif isinstance(t, mi.UnionType):
        found = any(_may_hold_paths(u) for u in t.types)
    else:
        found = False
    _HOLDS_PATHS[id(t)] = found
    return found


@functools.cache
def _type_info(cls: type) -> mi.Type:
    return mi.type_info(cls)


def _walk(value: object, t: mi.Type, at: str) -> Iterator[tuple[str, str, str]]:
    if value is None or not _may_hold_paths(t):
        return
    kind = _path_kind(t)
    if kind is not None:
        yield at, kind, value  # type: ignore[misc]
    elif isinstance(t, mi.Metadata):
        yield from _walk(value, t.type, at)
    elif isinstance(t, mi.StructType):
        for f in t.fields:
            yield from _walk(getattr(value, f.name), f.type, f"{at}.{f.encode_name}")
    elif isinstance(t, mi.ListType):
        for i, item in enumerate(value):  # type: ignore[arg-type]
            yield from _walk(item, t.item_type, f"{at}[{i}]")
    elif isinstance(t, mi.DictType):
        for key, item in value.items():  # type: ignore[union-attr]
            yield from _walk(item, t.value_type, f'{at}["{key}"]')
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            if isinstance(u, mi.StructType) and isinstance(value, u.cls):
                yield from _walk(value, u, at)
                return
        for u in t.types:  # an optional path or list: the one member that is not None
            if not isinstance(u, mi.NoneType | mi.StructType):
                yield from _walk(value, u, at)
                return


def path_fields(manifest: msgspec.Struct) -> Iterator[tuple[str, str, str]]:
    """(field path such as `$.shards[0].prefix`, path kind, value) of every path field of a decoded
    manifest, found through its type (so no path field can be missed)."""
    yield from _walk(manifest, _type_info(type(manifest)), "$")


def check_paths(manifest: Manifest, root: Path, where: str) -> None:
    """Every `file` and `prefix` path of the manifest is relative, stays inside `root` (no `..`,
    no symlink out) and names a file listed in `$.files`; `ref` and `record` paths are not
    artifact files (resolve refs with `resolve_ref`)."""
    listed = {e.path for e in manifest.files}
    checked: set[str] = set()  # thousands of pieces share a few files
    for at, kind, value in path_fields(manifest):
        if kind not in ("file", "prefix"):
            continue
        for rel in [value] if kind == "file" else [value + s for s in PREFIX_SUFFIXES]:
            if rel in checked:
                continue
            confined_path(root, rel, f"{where}: {at}")
            if rel not in listed:
                raise UserError(
                    f"{rel!r} names no file of the artifact (it is not in $.files)", f"{where}: {at}"
                )
            checked.add(rel)


# --- opening -------------------------------------------------------------------------------------


def read_manifest_bytes(path: Path) -> tuple[Path, bytes]:
    """The artifact root and its manifest bytes; `path` may be the directory or its manifest.json."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".json") and path.name != MANIFEST_NAME:
        return path.parent, path.read_bytes()  # a standalone manifest such as run.json
    root = path.parent if path.name == MANIFEST_NAME else path
    if not root.exists():
        raise UserError("no such artifact directory", str(root))
    if not root.is_dir():
        raise UserError("not an artifact directory", str(root))
    mf = root / MANIFEST_NAME
    if not mf.is_file():
        hint = " (an interrupted write?)" if root.name.endswith(".partial") or any(root.iterdir()) else ""
        raise UserError(f"incomplete artifact: no {MANIFEST_NAME}{hint}", str(root))
    return root, mf.read_bytes()


@overload
def open_artifact(path: Path, kind: Literal["tokens"], verify: Verify = ...) -> TokensManifest: ...
@overload
def open_artifact(path: Path, kind: Literal["checkpoint"], verify: Verify = ...) -> CheckpointManifest: ...
@overload
def open_artifact(path: Path, kind: Literal["run"], verify: Verify = ...) -> RunManifest: ...
@overload
def open_artifact(path: Path, kind: Literal["hf"], verify: Verify = ...) -> HFManifest: ...
@overload
def open_artifact(path: Path, kind: None = ..., verify: Verify = ...) -> Manifest: ...
def open_artifact(path: Path, kind: Kind | None = None, verify: Verify = "sha256") -> Manifest:
    """Decode and check an artifact: its paths always; as `verify` says, its data files (size or
    sha256) and, for a checkpoint, every piece against its safetensors file's header."""
    root, data = read_manifest_bytes(path)
    where = str(root / MANIFEST_NAME) if (root / MANIFEST_NAME).is_file() else str(path)
    manifest = decode_manifest(data, where, kind)
    check_paths(manifest, root, where)
    if verify == "none":
        return manifest
    for i, entry in enumerate(manifest.files):
        check_file(root, entry, f"{where}: $.files[{i}]", sha256=verify == "sha256")
    if isinstance(manifest, CheckpointManifest):
        check_pieces(manifest.tensors, root, where)
    return manifest


def check_file(root: Path, entry: FileEntry, where: str, sha256: bool = True) -> Path:
    """The file of `entry` (under `root`) exists with the manifest's size and, when `sha256`, its
    checksum; else `DamagedFile` naming it. Returns its path."""
    full = root / entry.path
    if not full.is_file():
        raise DamagedFile(f"{entry.path}: damaged (listed in the manifest but missing)", where)
    size = full.stat().st_size
    if size != entry.size:
        raise DamagedFile(
            f"{entry.path}: damaged (size {size} differs from the manifest's {entry.size})", where
        )
    if sha256:
        check_sha256(entry, sha256_file(full), where)
    return full


def check_sha256(entry: FileEntry, digest: str, where: str, piece: Piece | None = None) -> None:
    """`digest`, the sha256 of `entry`'s file (computed here by `check_file`, or by a reader while it
    reads the file), is the manifest's; else `DamagedFile` naming the file. With `piece`: `digest`
    is of that piece's bytes in the file, compared with `piece.sha256`; the error names its tensor."""
    if piece is None and digest != entry.sha256:
        raise DamagedFile(f"{entry.path}: damaged (sha256 differs from the manifest)", where)
    if piece is not None and digest != piece.sha256:
        raise DamagedFile(
            f"{entry.path}: damaged (sha256 of tensor {piece.key!r} differs from the manifest)", where
        )


def check_model_tensors(manifest: CheckpointManifest, where: str) -> None:
    """Every tensor the checkpoint's config implies (`model_tensors`) is in it with that shape: a
    hand-edited config whose files still match would otherwise build a model its weights do not
    fit. Other tensors (optimizer moments) are not the config's to judge. An adapter's
    (`manifest.adapter`): the A and B of every module it has an A of, with its rank's shapes."""
    for name, shape in _expected(manifest, where).items():
        entry = manifest.tensors.get(name)
        if entry is None:
            raise UserError(f"{name}: missing from the checkpoint, the config implies {list(shape)}", where)
        if tuple(entry.shape) != shape:
            raise UserError(
                f"{name}: shape {list(entry.shape)} in the checkpoint, the config implies {list(shape)}",
                where,
            )


def _expected(manifest: CheckpointManifest, where: str) -> dict[str, tuple[int, ...]]:
    if manifest.adapter is None:
        return model_tensors(manifest.config)
    known = model_tensors(manifest.config)
    modules = [
        n.removesuffix(f".{LORA_A}")
        for n in manifest.tensors
        if n.endswith(f".{LORA_A}") and not n.startswith(OPTIM_PREFIX)
    ]
    for module in modules:
        if f"{module}.weight" not in known or len(known[f"{module}.weight"]) != 2:
            raise UserError(f"{module}.{LORA_A}: the base model has no linear {module}", where)
    return adapter_tensors(manifest.config, modules, manifest.adapter.rank)


def artifact_root(path: Path) -> Path:
    return read_manifest_bytes(path)[0]


def parent_of(path: Path) -> Parent:
    """Lineage entry for an input artifact: its path (absolute, so that a later tool opening it,
    mega-export's model card, works from any directory), kind and the sha256 of its manifest."""
    root, data = read_manifest_bytes(path)
    manifest = decode_manifest(data, str(root))
    return Parent(path=str(Path(path).resolve()), kind=kind_of(manifest), manifest_sha256=sha256_bytes(data))


def base_record(base: Path, sha256: str, adapter_dir: Path, hf_source: HFSource | None) -> BaseModel:
    """What an adapter checkpoint that will be at `adapter_dir` (its final directory, not its
    staging one) records of its base checkpoint `base`, whose manifest's sha256 is `sha256`: its
    path absolute and relative to `adapter_dir` (`base_paths` tries both), and the Hugging Face
    model its weights came from (the base's `hf_source`, which a PEFT export names)."""
    base = Path(base).resolve()
    relative = os.path.relpath(base, Path(adapter_dir).resolve())
    return BaseModel(path=str(base), manifest_sha256=sha256, relative=relative, hf_source=hf_source)


def base_paths(adapter: Path, base: BaseModel) -> list[Path]:
    """Where an adapter checkpoint's base may be, in the order to try: relative to the adapter's own
    directory (the working directory does not matter, nor moving a tree holding both), then its
    absolute path (in adapters written before `relative`: as given, relative to the working
    directory then)."""
    root = artifact_root(adapter).resolve()
    near = [Path(os.path.normpath(resolve_ref(root, base.relative)))] if base.relative else []
    return [*near, Path(base.path)]


_HUB_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_snapshot(directory: Path, kind: str = "models") -> tuple[str, str] | None:
    """(repository id, commit) of a Hugging Face Hub cache snapshot directory
    (`<kind>--ORG--NAME/snapshots/<commit>`, as huggingface_hub downloads it), else None."""
    d = Path(directory).resolve()
    repo = d.parent.parent.name
    if d.parent.name != "snapshots" or not repo.startswith(f"{kind}--") or not _HUB_COMMIT.fullmatch(d.name):
        return None
    return repo.removeprefix(f"{kind}--").replace("--", "/"), d.name
