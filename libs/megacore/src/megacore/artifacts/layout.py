"""The tensor layout algebra: logical tensors as rectangular pieces in safetensors files.

A logical tensor (global shape, dtype) is held by pieces `{file, key, offset, shape}`. Any
rectangular slice of it can be assembled from any set of pieces that covers it, reading only the
bytes the slice needs (`safe_open(...).get_slice`). The same mechanism serves conversion (one
piece per tensor), resharding (any layout to any other), training (load what this rank needs)
and export.

Writing goes through `SafetensorsStreamWriter`, which knows every tensor's shape up front, writes
the header first and then streams the data, so a file larger than memory can be produced one
slice at a time, its sha256 computed on the way.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from megacore.artifacts.manifest import Piece, TensorEntry
from megacore.artifacts.reader import confined_path
from megacore.errors import UserError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)

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
_SAFETENSORS_CODES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "uint16": "U16",
    "uint8": "U8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


# --- boxes ---------------------------------------------------------------------------------------


def even_split(shape: Sequence[int], dim: int, parts: int) -> list[Box]:
    """Tensor-parallel split: `parts` equal blocks along `dim` (must divide exactly)."""
    if shape[dim] % parts:
        raise ValueError(f"dim {dim} of shape {list(shape)} does not divide into {parts} parts")
    return chunk_split(shape, dim, parts)


def chunk_split(shape: Sequence[int], dim: int, parts: int) -> list[Box]:
    """`torch.chunk` semantics, as FSDP2 shards dim 0: ceil-sized blocks, the last ones may be short
    or empty (empty blocks are kept so that block i always belongs to rank i)."""
    size = math.ceil(shape[dim] / parts) if shape[dim] else 0
    boxes = []
    for i in range(parts):
        start = min(i * size, shape[dim])
        stop = min(start + size, shape[dim])
        off = [0] * len(shape)
        shp = list(shape)
        off[dim], shp[dim] = start, stop - start
        boxes.append((tuple(off), tuple(shp)))
    return boxes


def sub_box(box: Box, inner: Box) -> Box:
    """`inner` is relative to `box`: return it in global coordinates."""
    return tuple(a + b for a, b in zip(box[0], inner[0], strict=True)), inner[1]


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they share no element."""
    off, shp = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# --- reading -------------------------------------------------------------------------------------


class TensorReader:
    """Assembles slices of logical tensors of one artifact, keeping safetensors files open."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._files: dict[str, object] = {}

    def _handle(self, file: str):
        h = self._files.get(file)
        if h is None:
            path = confined_path(self.root, file, f"{self.root}: piece file")
            if not path.is_file():
                raise UserError(f"piece file {file!r} is missing", str(self.root))
            h = safe_open(str(path), framework="pt")
            self._files[file] = h
        return h

    def read(self, name: str, entry: TensorEntry, box: Box | None = None) -> torch.Tensor:
        """The slice `box` (offset, shape) of the logical tensor; the whole tensor when None."""
        if box is None:
            box = ((0,) * len(entry.shape), tuple(entry.shape))
        off, shape = box
        if any(o < 0 or o + s > g for o, s, g in zip(off, shape, entry.shape, strict=True)):
            raise ValueError(f"{name}: box {box} is outside shape {entry.shape}")
        if numel(shape) == 0:
            return torch.empty(shape, dtype=TORCH_DTYPES[entry.dtype])
        for piece in entry.pieces:  # one piece holds the whole box: return its slice, no second copy
            pbox = (tuple(piece.offset), tuple(piece.shape))
            if len(piece.shape) and intersect(pbox, box) == (tuple(off), tuple(shape)):
                src = tuple(slice(o - p, o - p + s) for o, p, s in zip(off, piece.offset, shape, strict=True))
                data = self._handle(piece.file).get_slice(piece.key)[src]
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
            handle = self._handle(piece.file)
            # get_slice reads only the requested bytes; 0-d tensors have no slice to take.
            data = handle.get_tensor(piece.key) if not piece.shape else handle.get_slice(piece.key)[src]
            if list(data.shape) != list(hshape):
                raise UserError(
                    f"{name}: piece {piece.key!r} in {piece.file} has shape {list(data.shape)}, "
                    f"expected {list(hshape)}",
                    str(self.root),
                )
            out[dst] = data.to(out.dtype) if data.dtype != out.dtype else data
            covered += numel(hshape)
        if covered != numel(shape):
            raise UserError(
                f"{name}: the pieces cover {covered} of {numel(shape)} elements asked for", str(self.root)
            )
        return out

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- writing -------------------------------------------------------------------------------------


class _HashThread:
    """sha256 on a helper thread, so hashing overlaps writing and reading (all release the GIL).
    Data waits in a short queue of blocks of at most 64 MiB; each keeps its tensor alive until hashed."""

    _BLOCK, _QUEUED = 64 << 20, 2

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._q: queue.Queue = queue.Queue(maxsize=self._QUEUED)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._digest: str | None = None

    def _run(self) -> None:
        while (data := self._q.get()) is not None:
            self._h.update(data)

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._BLOCK):
            self._q.put(view[start : start + self._BLOCK])

    def hexdigest(self) -> str:
        """Wait for the queued data and stop the thread (further calls return the same digest)."""
        if self._digest is None:
            self._q.put(None)
            self._thread.join()
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
                "dtype": _SAFETENSORS_CODES[dtype],
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
        self._hash = _HashThread()
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


def piece_entry(shape: Sequence[int], dtype: str, pieces: list[Piece]) -> TensorEntry:
    """A TensorEntry, checking that the pieces tile the tensor exactly (no gap, no overlap)."""
    total = 0
    for p in pieces:
        if len(p.offset) != len(shape) or len(p.shape) != len(shape):
            raise ValueError(f"piece {p.key} rank differs from tensor shape {list(shape)}")
        if any(o < 0 or o + s > g for o, s, g in zip(p.offset, p.shape, shape, strict=True)):
            raise ValueError(f"piece {p.key} {p.offset}+{p.shape} is outside {list(shape)}")
        total += numel(p.shape)
    if total != numel(shape):
        raise ValueError(f"pieces hold {total} elements, tensor has {numel(shape)}")
    boxes = [(tuple(p.offset), tuple(p.shape)) for p in pieces if numel(p.shape)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if intersect(a, b) is not None:
                raise ValueError(f"pieces {a} and {b} overlap")
    return TensorEntry(shape=list(shape), dtype=dtype, pieces=pieces)
