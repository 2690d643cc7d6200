"""Reading and writing tensors of the layout algebra (pieces.py) in safetensors files.

Any rectangular slice of a logical tensor is assembled from whatever pieces cover it, reading only
the bytes the slice needs (`safe_open(...).get_slice`): the one mechanism behind conversion,
resharding, a training rank loading its shard, and export. `TensorReader` checks each file
against the manifest the first time it opens it: its size at once (a cut file is refused before
any of its bytes are used), and on helper threads while the caller reads, converts and writes,
the sha256 of each piece it reads (`Piece.sha256`: that piece's byte range alone, so exporting the
weights of a training checkpoint does not hash its optimizer moments) or, for a checkpoint
without piece sums, of the whole file (`reader.check_file`, `reader.check_sha256`). The rule that
keeps damage out: what is read is checked while read, confirmed before anything made from it is
kept. `TensorReader.confirm()` waits for the sums and raises `DamagedFile` for damage; a caller
calls it before it commits an output or hands over what it read (`close()`, and leaving a `with`
block without an error, confirm too), so a damaged file yields `DamagedFile`, never garbage
weights kept. `SafetensorsStreamWriter` knows every tensor's shape up front, writes the header
first and then streams the data, so a file larger than memory is produced one slice at a time,
its sha256 (and, asked, each tensor's) computed on the way.
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

from megacore.artifacts.codec import decode_manifest
from megacore.artifacts.header import MANIFEST_NAME, FileEntry
from megacore.artifacts.manifest import Piece, TensorEntry
from megacore.artifacts.pieces import SAFETENSORS_CODES, Box, intersect, numel, safetensors_layout, whole
from megacore.artifacts.reader import check_file, check_sha256, confined_path, read_manifest_bytes
from megacore.artifacts.writer import sha256_file
from megacore.background import Background, Jobs, result
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


# Whether a TensorReader hashes what it reads (pieces, or whole files). Only bench/bench_checkpoint.py turns it off, to
# measure what the check costs; nothing else may.
CHECK_SHA256 = True

# Files one reader hashes at once: a checkpoint of several ranks' files has several sums running
# while they are read, each file's (its pieces in turn, one `Jobs` lane) one core's sequential pass;
# the cap leaves cores to the caller (and to the other ranks of a node, each with its own reader)
# and the disk to fewer streams.
HASH_WORKERS = min(4, os.cpu_count() or 1)


class TensorReader:
    """Assembles slices of logical tensors of one artifact, keeping safetensors files open.

    Each file is checked against the manifest's `$.files` (`files`; default: read from the
    artifact's manifest) the first time it is opened: its size then. Its bytes are hashed on helper
    threads (up to `HASH_WORKERS` files at once, a file's pieces in turn) while the caller goes on,
    once per reader (`release` keeps that): each piece's own range, the first time any of it is
    read, when the piece has a sha256 (`Piece.sha256`; its header entry is checked against the
    manifest, so the bytes hashed are the bytes read); else the whole file (checkpoints written
    before piece sums). A reader vouches for what it reads: damage to a piece it does not read goes
    unseen by it (`--verify sha256` checks whole files). `confirm()` waits for those sums and raises
    `DamagedFile` naming the first damaged file (in `$.files` order) and, for a piece, its tensor;
    call it before keeping anything made from what was read. `close()` and a `with` block left
    without an error confirm too; left by an error, the sums still running are stopped instead (that
    error is the one reported). `verified`: files the caller has already hashed against that
    manifest (`open_artifact(..., verify="sha256")`), not hashed again."""

    def __init__(
        self, root: Path, files: Sequence[FileEntry] | None = None, verified: Iterable[str] = ()
    ) -> None:
        self.root = Path(root)
        self._where = str(self.root / MANIFEST_NAME)
        if files is None:
            files = decode_manifest(read_manifest_bytes(self.root)[1], self._where).files
        self._listed = {e.path: (i, e) for i, e in enumerate(files)}
        # Sums hashed or being hashed (in _pending): (file, None) a whole file, (file, key) a piece.
        self._checked: set[tuple[str, str | None]] = {(f, None) for f in verified}
        self._pending: dict[tuple[str, str | None], tuple[Future[str], Piece | None]] = {}
        self._layouts: dict[str, tuple[int, dict]] = {}  # file -> safetensors_layout, for piece ranges
        self._damage: DamagedFile | None = None  # once found, every confirm raises it again
        self._jobs: Jobs | None = None  # started with the first sum
        self._files: dict[str, object] = {}

    def _at(self, file: str) -> str:
        return f"{self._where}: $.files[{self._listed[file][0]}]"

    def _check(self, file: str) -> Path:
        """The path of `file`, confined to the artifact, listed, with the manifest's size."""
        confined_path(self.root, file, f"{self.root}: piece file")
        if file not in self._listed:
            raise UserError(f"piece file {file!r} is not listed in $.files", self._where)
        return check_file(self.root, self._listed[file][1], self._at(file), sha256=False)

    def _hash(self, piece: Piece, dtype: str) -> None:
        """Start the sum that vouches for `piece` (once): its own bytes when it has a sha256, else its
        whole file's; none when its file is hashed whole already."""
        file = piece.file
        if not CHECK_SHA256 or (file, None) in self._checked:
            return
        key = None if piece.sha256 is None else piece.key
        if (file, key) in self._checked:
            return
        path = self.root / file
        span = None if key is None else self._span(piece, dtype)
        if self._jobs is None:
            self._jobs = Jobs(HASH_WORKERS, name="mega-sha256")
        job = self._jobs.submit(sha256_file, path, self._jobs.stop, span, lane=file)
        self._pending[(file, key)] = (job, None if key is None else piece)
        self._checked.add((file, key))

    def _span(self, piece: Piece, dtype: str) -> tuple[int, int]:
        """The byte range of `piece` in its file, from the file's header, whose entry for it must be
        what the manifest says (the piece's sum covers its data, not the header that locates it)."""
        if piece.file not in self._layouts:
            try:
                self._layouts[piece.file] = safetensors_layout(self.root / piece.file)
            except UserError as e:
                raise self._unreadable(str(e), piece.file) from None
        start, header = self._layouts[piece.file]
        info = header.get(piece.key)
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(info, dict)
            or info.get("dtype") != SAFETENSORS_CODES.get(dtype)
            or info.get("shape") != piece.shape
            or not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets))
        ):
            message = f"{piece.file}: the header's entry of {piece.key!r} is not the manifest's"
            raise self._unreadable(message, piece.file)
        return start + offsets[0], start + offsets[1]

    def confirm(self) -> None:
        """Wait for every sum started so far; `DamagedFile` naming the first file (in `$.files` order)
        whose bytes differ from the manifest, the others' sums then abandoned. Cheap when nothing
        is pending; a reader found damaged raises the same error on every call."""
        for job in sorted(self._pending, key=lambda job: self._listed[job[0]][0]):
            if self._damage is not None:
                break
            future, piece = self._pending[job]
            try:
                check_sha256(self._listed[job[0]][1], result(future), self._at(job[0]), piece)
            except DamagedFile as e:
                self._damage = e
            else:
                del self._pending[job]
        if self._damage is not None:
            self._stop_hashing()
            raise self._damage

    def _stop_hashing(self) -> None:
        """Abandon the sums not confirmed: their bytes count as unchecked again, should this reader
        read them once more."""
        self._checked.difference_update(self._pending)
        self._pending.clear()
        if self._jobs is not None:
            self._jobs.cancel()
            self._jobs = None

    def _unreadable(self, message: str, file: str) -> UserError:
        """The error for bytes that do not read as their header says: a damaged file is the likely
        cause, so the pending sums are confirmed first, and `file` hashed whole unless it was
        (`DamagedFile` if one differs)."""
        self.confirm()
        if CHECK_SHA256 and (file, None) not in self._checked and file in self._listed:
            check_file(self.root, self._listed[file][1], self._at(file))
            self._checked.add((file, None))
        return UserError(message, str(self.root))

    def _handle(self, file: str):
        h = self._files.get(file)
        if h is None:
            path = self._check(file)
            try:
                h = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise self._unreadable(f"{file}: not a readable safetensors file ({e})", file) from None
            self._files[file] = h
        return h

    def _get(self, piece: Piece, dtype: str, src: tuple[slice, ...]) -> torch.Tensor:
        """`src` of `piece`, reading only those bytes (0-d tensors have no slice), its sum started."""
        handle = self._handle(piece.file)
        self._hash(piece, dtype)
        try:
            return handle.get_slice(piece.key)[src] if src else handle.get_tensor(piece.key)
        except SafetensorError as e:
            raise self._unreadable(f"{piece.file}: no tensor {piece.key!r} ({e})", piece.file) from None

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
                data = self._get(piece, entry.dtype, src)
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
            data = self._get(piece, entry.dtype, src)
            if list(data.shape) != list(hshape):
                raise self._unreadable(
                    f"{name}: piece {piece.key!r} in {piece.file} has shape {list(data.shape)}, "
                    f"expected {list(hshape)}",
                    piece.file,
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


class _Sha256s:
    """sha256s of named byte streams on a helper thread (hashing overlaps writing and reading: all
    release the GIL), fed in blocks of at most 64 MiB; each block keeps its tensor alive until
    hashed."""

    _BLOCK = 64 << 20

    def __init__(self) -> None:
        self._sums: dict[str, hashlib._Hash] = {}
        self._bg = Background.sink(self._update, depth=2, name="mega-sha256")
        self._digests: dict[str, str] | None = None

    def _update(self, item: tuple[str, memoryview]) -> None:
        name, block = item
        self._sums.setdefault(name, hashlib.sha256()).update(block)

    def update(self, name: str, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._BLOCK):
            self._bg.put((name, view[start : start + self._BLOCK]))

    def hexdigests(self) -> dict[str, str]:
        """Wait for the queued data and stop the thread (further calls return the same digests)."""
        if self._digests is None:
            self._bg.close()
            self._digests = {name: h.hexdigest() for name, h in self._sums.items()}
        return self._digests


class SafetensorsStreamWriter:
    """Writes a safetensors file whose tensors are all declared up front and then streamed.

    `declare` every (key, dtype, shape) first, then `write(key, tensor)` slices in any order of
    keys but each key's data as one contiguous tensor, or `write_part` row blocks of a key in order.
    Memory stays at one slice; the file's sha256 is computed on the way (for the manifest), on a
    helper thread: a written tensor must not be modified before `close()`. `piece_sums`: each
    tensor's sha256 too (of its bytes alone, `piece_sha256s()` after `close()`), on a second
    helper thread so the two sums run side by side and the caller waits for neither.
    """

    def __init__(
        self,
        path: Path,
        tensors: Iterable[tuple[str, str, Sequence[int]]],
        metadata: dict | None = None,
        piece_sums: bool = False,
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
        self._hash = _Sha256s()
        self._piece_hash = _Sha256s() if piece_sums else None
        prefix = struct.pack("<Q", len(raw)) + raw
        self._f.write(prefix)
        self._hash.update("", prefix)
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
        self._hash.update("", data)
        if self._piece_hash is not None:
            self._piece_hash.update(key, data)
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
        if self._piece_hash is not None:
            self._piece_hash.hexdigests()
        return self._hash.hexdigests()[""]

    def piece_sha256s(self) -> dict[str, str]:
        """After `close()`, with `piece_sums`: every tensor's sha256, of its bytes in the file."""
        if self._piece_hash is None or not self._f.closed:
            raise RuntimeError(f"{self.path}: no piece sums (asked for, and the file closed?)")
        empty = hashlib.sha256().hexdigest()  # an empty tensor has no bytes, so none was fed
        return {key: self._piece_hash.hexdigests().get(key, empty) for key in self._order}

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # an unfinished file: closed, and the hash thread stopped
            self._f.close()
            self._hash.hexdigests()
            if self._piece_hash is not None:
                self._piece_hash.hexdigests()
