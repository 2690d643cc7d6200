"""Atomic artifact writing: build in `<out>.partial/`, write the manifest last, fsync, rename.

A crash at any point leaves either the old artifact untouched or no `manifest.json` at `<out>`:
never something that looks complete and is not.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megacore.artifacts.manifest import MANIFEST_NAME, FileEntry, Manifest, encode_manifest
from megacore.errors import UserError

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file, fsync and rename (also used for manifests)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class ArtifactWriter:
    """Collects an artifact's files in a staging directory; `commit` makes it appear at once.

    Write data files under `writer.dir`, then call `commit(manifest)`: it lists and hashes every
    file (unless the caller recorded them already with `record`), writes `manifest.json` last and
    renames the staging directory into place.
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.dir = self.out.with_name(self.out.name + ".partial")
        self._recorded: dict[str, FileEntry] = {}

    def path(self, relpath: str) -> Path:
        p = self.dir / relpath
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def record(self, relpath: str, sha256: str, size: int | None = None) -> None:
        """Record a file's checksum computed while it was written, so commit need not reread it."""
        size = (self.dir / relpath).stat().st_size if size is None else size
        self._recorded[relpath] = FileEntry(path=relpath, size=size, sha256=sha256)

    def file_entries(self) -> list[FileEntry]:
        entries = []
        for p in sorted(self.dir.rglob("*")):
            if p.is_symlink():
                raise RuntimeError(f"{p}: artifacts may not contain symlinks")
            if not p.is_file():
                continue
            rel = p.relative_to(self.dir).as_posix()
            if rel == MANIFEST_NAME:
                continue
            entry = self._recorded.get(rel)
            if entry is None or entry.size != p.stat().st_size:
                entry = FileEntry(path=rel, size=p.stat().st_size, sha256=sha256_file(p))
            entries.append(entry)
        return entries

    def commit(self, manifest: Manifest) -> Manifest:
        """Fill in `files`, write the manifest last, and move the artifact into place."""
        manifest.files = self.file_entries()
        for e in manifest.files:
            with open(self.dir / e.path, "rb") as f:
                os.fsync(f.fileno())
        write_file_atomic(self.dir / MANIFEST_NAME, encode_manifest(manifest))
        old = None
        if self.out.exists():
            # Keep the old artifact until the new one is in place; delete it only afterwards.
            old = self.out.with_name(f"{self.out.name}.replaced-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.dir, self.out)
        _fsync_dir(self.out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def write_artifact(out: Path, *, force: bool = False) -> Iterator[ArtifactWriter]:
    """Stage an artifact at `<out>.partial/`; the body must call `writer.commit(manifest)`.

    An existing complete artifact at `out` is replaced only with `force`; anything at `out` that is
    not an artifact (no manifest) is refused, so no user data is ever deleted by mistake.
    """
    out = Path(out)
    if out.exists():
        if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
            raise UserError("exists and is not an artifact (no manifest.json); choose another path", str(out))
        if (out / MANIFEST_NAME).is_file() and not force:
            raise UserError("already exists; pass --force to rebuild it", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = ArtifactWriter(out)
    if writer.dir.exists():  # leftover of an interrupted run
        shutil.rmtree(writer.dir)
    writer.dir.mkdir(parents=True)
    committed = False
    try:
        yield writer
        committed = (out / MANIFEST_NAME).is_file() and not writer.dir.exists()
    finally:
        if not committed:
            writer.abort()
