"""Reading and writing tensors of the layout algebra (pieces.py) in safetensors files.

Any rectangular slice of a logical tensor is assembled from whatever pieces cover it, reading only
the bytes the slice needs (`safe_open(...).get_slice`): the one mechanism behind conversion,
resharding, a training rank loading its shard, and export. `TensorReader` checks each file
against the manifest the first time it opens it: its size at once (a cut file is refused before
any of its bytes are used), its sha256 on a helper thread while the caller reads, converts and
writes (`reader.check_file`, `reader.check_sha256`). The rule that keeps damage out: files are
checked while read, confirmed before anything made from them is kept. `TensorReader.confirm()`
waits for the sums and raises `DamagedFile` for a damaged file; a caller calls it before it
commits an output or hands over what it read (`close()`, and leaving a `with` block without an
error, confirm too), so a damaged file yields `DamagedFile`, never garbage weights kept.
`SafetensorsStreamWriter` knows every tensor's shape up front, writes the header first and then
streams the data, so a file larger than memory is produced one slice at a time, its sha256
computed on the way.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megacore.artifacts.manifest import MANIFEST_NAME, FileEntry, TensorEntry, decode_manifest
from megacore.artifacts.pieces import SAFETENSORS_CODES, Box, intersect, numel, whole
from megacore.artifacts.reader import check_file, check_sha256, confined_path, read_manifest_bytes
from megacore.artifacts.writer import sha256_file
from megacore.background import Background, Jobs
from megacore.errors import DamagedFile, UserError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint16": torch.uint16,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


# --- reading -------------------------------------------------------------------------------------


# Whether a TensorReader hashes the files it opens. Only bench/bench_checkpoint.py turns it off, to
# measure what the check costs; nothing else may.
CHECK_SHA256 = True

# Files one reader hashes at once: a checkpoint of several ranks' files has several sums running
# while they are read, each one core's sequential pass; the cap leaves cores to the caller (and to
# the other ranks of a node, each with its own reader) and the disk to fewer streams.
HASH_WORKERS = min(4, os.cpu_count() or 1)


class TensorReader:
    """Assembles slices of logical tensors of one artifact, keeping safetensors files open.

    Each file is checked against the manifest's `$.files` (`files`; default: read from the
    artifact's manifest) the first time it is opened: its size then, its sha256 on a helper thread
    (up to `HASH_WORKERS` files at once) while the caller goes on, once per reader (`release`
    keeps that). `confirm()` waits for those sums and raises `DamagedFile` naming the first
    damaged file (in `$.files` order); call it before keeping anything made from what was read.
    `close()` and a `with` block left without an error confirm too; left by an error, the sums
    still running are stopped instead (that error is the one reported). `verified`: files the
    caller has already hashed against that manifest (`open_artifact(..., verify="sha256")`), not
    hashed again."""

    def __init__(
        self, root: Path, files: Sequence[FileEntry] | None = None, verified: Iterable[str] = ()
    ) -> None:
        self.root = Path(root)
        self._where = str(self.root / MANIFEST_NAME)
        if files is None:
            files = decode_manifest(read_manifest_bytes(self.root)[1], self._where).files
        self._listed = {e.path: (i, e) for i, e in enumerate(files)}
        self._checked: set[str] = set(verified)  # hashed, or being hashed (in _pending)
        self._pending: dict[str, Future[str]] = {}
        self._damage: DamagedFile | None = None  # once found, every confirm raises it again
        self._jobs: Jobs | None = None  # started with the first sum
        self._files: dict[str, object] = {}

    def _check(self, file: str) -> Path:
        """The path of `file`, confined to the artifact, with the manifest's size; the first time,
        its sha256 is started on a helper thread (`confirm` collects it)."""
        confined_path(self.root, file, f"{self.root}: piece file")
        if file not in self._listed:
            raise UserError(f"piece file {file!r} is not listed in $.files", self._where)
        i, entry = self._listed[file]
        path = check_file(self.root, entry, f"{self._where}: $.files[{i}]", sha256=False)
        if CHECK_SHA256 and file not in self._checked:
            if self._jobs is None:
                self._jobs = Jobs(HASH_WORKERS, name="mega-sha256")
            self._pending[file] = self._jobs.submit(sha256_file, path, self._jobs.stop)
        self._checked.add(file)
        return path

    def confirm(self) -> None:
        """Wait for the sha256 of every file opened so far; `DamagedFile` naming the first one (in
        `$.files` order) that differs from the manifest, the others' sums then abandoned. Cheap
        when nothing is pending; a reader found damaged raises the same error on every call."""
        for file in sorted(self._pending, key=lambda f: self._listed[f][0]):
            if self._damage is not None:
                break
            i, entry = self._listed[file]
            try:
                check_sha256(entry, self._pending[file].result(), f"{self._where}: $.files[{i}]")
            except DamagedFile as e:
                self._damage = e
            else:
                del self._pending[file]
        if self._damage is not None:
            self._stop_hashing()
            raise self._damage

    def _stop_hashing(self) -> None:
        """Abandon the sums not confirmed: their files count as unchecked again, should this reader
        open them once more."""
        self._checked.difference_update(self._pending)
        self._pending.clear()
        if self._jobs is not None:
            self._jobs.cancel()
            self._jobs = None

    def _unreadable(self, message: str) -> UserError:
        """The error for bytes that do not read as their header says: a damaged file is the likely
        cause, so the pending sums are confirmed first (`DamagedFile` if one differs)."""
        self.confirm()
        return UserError(message, str(self.root))

    def _handle(self, file: str):
        h = self._files.get(file)
        if h is None:
            path = self._check(file)
            try:
                h = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise self._unreadable(f"{file}: not a readable safetensors file ({e})") from None
            self._files[file] = h
        return h

    def _get(self, file: str, key: str, src: tuple[slice, ...]) -> torch.Tensor:
        """`src` of tensor `key` in `file`, reading only those bytes (0-d tensors have no slice)."""
        handle = self._handle(file)
        try:
            return handle.get_slice(key)[src] if src else handle.get_tensor(key)
        except SafetensorError as e:
            raise self._unreadable(f"{file}: no tensor {key!r} ({e})") from None

    def read(self, name: str, entry: TensorEntry, box: Box | None = None) -> torch.Tensor:
        """The slice `box` (offset, shape) of the logical tensor; the whole tensor when None."""
        if box is None:
            box = whole(entry.shape)
        off, shape = box
        if any(o < 0 or o + s > g for o, s, g in zip(off, shape, entry.shape, strict=True)):
            raise ValueError(f"{name}: box {box} is outside shape {entry.shape}")
        if numel(shape) == 0:
            return torch.empty(shape, dtype=TORCH_DTYPES[entry.dtype])
        for piece in entry.pieces:  # one piece holds the whole box: return its slice, no second copy
            pbox = (tuple(piece.offset), tuple(piece.shape))
            if len(piece.shape) and intersect(pbox, box) == (tuple(off), tuple(shape)):
                src = tuple(slice(o - p, o - p + s) for o, p, s in zip(off, piece.offset, shape, strict=True))
                data = self._get(piece.file, piece.key, src)
                if list(data.shape) == list(shape):
                    return data.to(TORCH_DTYPES[entry.dtype])
        out = torch.empty(shape, dtype=TORCH_DTYPES[entry.dtype])
        covered = 0
        for piece in entry.pieces:
            pbox = (tuple(piece.offset), tuple(piece.shape))
            hit = intersect(pbox, box)
            if hit is None:
                continue
            hoff, hshape = hit
            src = tuple(slice(h - p, h - p + s) for h, p, s in zip(hoff, piece.offset, hshape, strict=True))
            dst = tuple(slice(h - o, h - o + s) for h, o, s in zip(hoff, off, hshape, strict=True))
            data = self._get(piece.file, piece.key, src)
            if list(data.shape) != list(hshape):
                raise self._unreadable(
                    f"{name}: piece {piece.key!r} in {piece.file} has shape {list(data.shape)}, "
                    f"expected {list(hshape)}"
                )
            out[dst] = data.to(out.dtype) if data.dtype != out.dtype else data
            covered += numel(hshape)
        if covered != numel(shape):
            raise UserError(
                f"{name}: the pieces cover {covered} of {numel(shape)} elements asked for", str(self.root)
            )
        return out

    def release(self) -> None:
        """Unmap the files opened so far (pages of a mapping left open count as resident memory);
        their sums go on, and a file opened again is not hashed again."""
        self._files.clear()

    def close(self) -> None:
        """`confirm`, then release the files and the hashing threads (whatever `confirm` raised)."""
        try:
            self.confirm()
        finally:
            self._stop_hashing()
            self.release()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the error in flight is reported; nothing read will be kept, so no sum is waited for
            self._stop_hashing()
            self.release()


# --- writing -------------------------------------------------------------------------------------


class _Sha256:
    """sha256 on a helper thread (hashing overlaps writing and reading: all release the GIL), fed in
    blocks of at most 64 MiB; each block keeps its tensor alive until hashed."""

    _BLOCK = 64 << 20

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._bg = Background.sink(self._h.update, depth=2, name="mega-sha256")
        self._digest: str | None = None

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._BLOCK):
            self._bg.put(view[start : start + self._BLOCK])

    def hexdigest(self) -> str:
        """Wait for the queued data and stop the thread (further calls return the same digest)."""
        if self._digest is None:
            self._bg.close()
            self._digest = self._h.hexdigest()
        return self._digest


class SafetensorsStreamWriter:
    """Writes a safetensors file whose tensors are all declared up front and then streamed.

    `declare` every (key, dtype, shape) first, then `write(key, tensor)` slices in any order of
    keys but each key's data as one contiguous tensor, or `write_part` row blocks of a key in order.
    Memory stays at one slice; the file's sha256 is computed on the way (for the manifest), on a
    helper thread: a written tensor must not be modified before `close()`.
    """

    def __init__(
        self,
        path: Path,
        tensors: Iterable[tuple[str, str, Sequence[int]]],
        metadata: dict | None = None,
    ):
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        pos = 0
        self._spans: dict[str, tuple[int, int]] = {}
        self._shapes: dict[str, Sequence[int]] = {}
        for key, dtype, shape in tensors:
            nbytes = numel(shape) * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
            header[key] = {
                "dtype": SAFETENSORS_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [pos, pos + nbytes],
            }
            self._spans[key] = (pos, pos + nbytes)
            self._shapes[key] = shape
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._order = list(self._spans)
        self._next = 0  # index in _order of the key being written; data must arrive in file order
        self._written_in_key = 0
        self._skip_empty()
        self._f = open(self.path, "wb")  # noqa: SIM115 - held open across write() calls, closed by close()
        self._hash = _Sha256()
        prefix = struct.pack("<Q", len(raw)) + raw
        self._f.write(prefix)
        self._hash.update(prefix)
        self.size = self._data_start + pos

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append data of `key` (a whole tensor or the next rows of it, in file order)."""
        if key in self._shapes and numel(self._shapes[key]) == 0 and tensor.numel() == 0:
            return  # empty tensors hold no bytes; nothing to wait for or write
        if self._next >= len(self._order) or self._order[self._next] != key:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise RuntimeError(f"{self.path}: wrote {key!r}, expected {expected!r} next")
        start, stop = self._spans[key]
        # A uint8 view, no byte copy: memory stays at the caller's slice.
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data
        self._f.write(data)
        self._hash.update(data)
        self._written_in_key += data.nbytes
        if self._written_in_key > stop - start:
            raise RuntimeError(f"{self.path}: too much data for {key!r}")
        if self._written_in_key == stop - start:
            self._next += 1
            self._written_in_key = 0
            self._skip_empty()

    def _skip_empty(self) -> None:
        # Empty tensors have no bytes to wait for.
        while self._next < len(self._order) and numel(self._shapes[self._order[self._next]]) == 0:
            self._next += 1

    def close(self) -> str:
        """Finish the file; returns its sha256 (closing twice is harmless)."""
        if not self._f.closed:
            self._skip_empty()
            if self._next != len(self._order):
                self._f.close()
                raise RuntimeError(f"{self.path}: closed before {self._order[self._next]!r} was written")
            self._f.close()
        return self._hash.hexdigest()

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # an unfinished file: closed, and the hash thread stopped
            self._f.close()
            self._hash.hexdigest()
