"""Opening artifacts: manifest decoding, path confinement and checksum verification.

Every tool opens its inputs through `open_artifact`; the errors are UserErrors (exit 2) that name
the artifact and the offending field or file.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Literal, overload

from megacore.artifacts.manifest import (
    MANIFEST_NAME,
    CheckpointManifest,
    Kind,
    Manifest,
    Parent,
    RunManifest,
    TokensManifest,
    decode_manifest,
)
from megacore.artifacts.writer import sha256_bytes, sha256_file
from megacore.errors import UserError

Verify = Literal["sha256", "size", "none"]


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
def open_artifact(path: Path, kind: None = ..., verify: Verify = ...) -> Manifest: ...
def open_artifact(path: Path, kind: Kind | None = None, verify: Verify = "sha256") -> Manifest:
    """Decode and check an artifact. `verify` chooses how hard the data files are checked."""
    root, data = read_manifest_bytes(path)
    where = str(root / MANIFEST_NAME) if (root / MANIFEST_NAME).is_file() else str(path)
    manifest = decode_manifest(data, where, kind)
    for i, entry in enumerate(manifest.files):
        at = f"{where}: $.files[{i}]"
        full = confined_path(root, entry.path, at)
        if verify == "none":
            continue
        if not full.is_file():
            raise UserError(f"{entry.path}: listed in the manifest but missing", at)
        size = full.stat().st_size
        if size != entry.size:
            raise UserError(f"{entry.path}: size {size} differs from the manifest's {entry.size}", at)
        if verify == "sha256" and sha256_file(full) != entry.sha256:
            raise UserError(f"{entry.path}: sha256 differs from the manifest (corrupted or edited)", at)
    return manifest


def artifact_root(path: Path) -> Path:
    return read_manifest_bytes(path)[0]


def parent_of(path: Path) -> Parent:
    """Lineage entry for an input artifact: path as given, kind and the sha256 of its manifest."""
    root, data = read_manifest_bytes(path)
    manifest = decode_manifest(data, str(root))
    kind = type(manifest).__struct_config__.tag
    return Parent(path=str(path), kind=kind, manifest_sha256=sha256_bytes(data))
