"""Atomic artifact writing: build in `<out>.partial/`, write the manifest last, fsync, rename.

A crash at any point leaves either the old artifact untouched or no `manifest.json` at `<out>`:
never something that looks complete and is not. The staging directory carries a mark
(`STAGING_MARK`: which process made it), removed at commit, by which a later run knows a leftover
`<out>.partial/` as its own. Where an artifact may be written at all is `output.py`'s policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path

from megacore.artifacts.codec import encode_manifest
from megacore.artifacts.header import MANIFEST_NAME, FileEntry, Kind
from megacore.artifacts.manifest import Manifest, kind_of

_HASH_BLOCK = 8 << 20
STAGING_MARK = ".mega-staging"


def sha256_file(path: Path, stop: threading.Event | None = None, span: tuple[int, int] | None = None) -> str:
    """The file's sha256, read sequentially in large blocks into one reused buffer (hashlib releases
    the GIL while it hashes; the kernel reads ahead, told the access is sequential). `span`: only
    the bytes [start, end) (a piece's data in a safetensors file); a file shorter than that hashes
    what there is, which matches no sum written for the whole span.

    `stop` (hashing on a helper thread for a caller that may give up): once set, the next block
    returns "" instead, which is no file's sha256, so a stopped sum never passes for a good one."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    start, end = span if span is not None else (0, None)
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), start, 0 if end is None else end - start, os.POSIX_FADV_SEQUENTIAL)
        f.seek(start)
        left = -1 if end is None else end - start  # -1: to the end of the file
        while left and (n := f.readinto(view if left < 0 else view[: min(left, _HASH_BLOCK)])):
            if stop is not None and stop.is_set():
                return ""
            h.update(view[:n])
            left -= 0 if left < 0 else n
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


def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


class ArtifactWriter:
    """Collects an artifact's files in a staging directory; `commit` makes it appear at once.

    `stage()` creates the directory (one process does; others of a job may write into it), data
    files go under `writer.dir`, then `commit(manifest)` lists and hashes every file (unless the
    caller recorded them already with `record`), sets the recipe, writes `manifest.json` last and
    renames the staging directory into place. Use it through `output.write_artifact`, which applies
    the output policy first.
    """

    def __init__(self, out: Path, kind: Kind, recipe: str | None = None) -> None:
        self.out = Path(out)
        self.kind = kind
        self.recipe = recipe
        self.dir = staging_dir(self.out)
        self.committed = False
        self._recorded: dict[str, FileEntry] = {}

    def stage(self) -> None:
        self.dir.mkdir(parents=True)
        mark = {"pid": os.getpid(), "host": socket.gethostname(), "kind": self.kind}
        mark["started"] = datetime.now(UTC).isoformat(timespec="seconds")
        (self.dir / STAGING_MARK).write_text(json.dumps(mark) + "\n")

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
            if rel in (MANIFEST_NAME, STAGING_MARK):
                continue
            entry = self._recorded.get(rel)
            if entry is None or entry.size != p.stat().st_size:
                entry = FileEntry(path=rel, size=p.stat().st_size, sha256=sha256_file(p))
            entries.append(entry)
        return entries

    def commit(self, manifest: Manifest) -> Manifest:
        """Fill in `files` and the recipe, write the manifest last, and move the artifact into place."""
        if kind_of(manifest) != self.kind:
            raise RuntimeError(f"a {kind_of(manifest)} manifest committed as a {self.kind} artifact")
        if self.recipe is not None:
            manifest.recipe_sha256 = self.recipe
        manifest.files = self.file_entries()
        for e in manifest.files:
            with open(self.dir / e.path, "rb") as f:
                os.fsync(f.fileno())
        (self.dir / STAGING_MARK).unlink(missing_ok=True)
        write_file_atomic(self.dir / MANIFEST_NAME, encode_manifest(manifest))
        old = None
        if self.out.exists():
            # The output policy allowed replacing it (an empty directory, or our own artifact);
            # keep it until the new one is in place, delete it only afterwards.
            old = self.out.with_name(f"{self.out.name}.replaced-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.dir, self.out)
        _fsync_dir(self.out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.committed = True
        return manifest

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
