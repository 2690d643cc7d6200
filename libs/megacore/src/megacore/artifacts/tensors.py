"""Reading and writing tensors of the layout algebra (pieces.py) in safetensors files.

Any rectangular slice of a logical tensor is assembled from whatever pieces cover it, reading only
the bytes the slice needs (`safe_open(...).get_slice`): the one mechanism behind conversion,
resharding, a training rank loading its shard, and export. `SafetensorsStreamWriter` knows every
tensor's shape up front, writes the header first and then streams the data, so a file larger than
memory is produced one slice at a time, its sha256 computed on the way.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megacore.artifacts.manifest import TensorEntry
from megacore.artifacts.pieces import SAFETENSORS_CODES, Box, intersect, numel, whole
from megacore.artifacts.reader import confined_path
from megacore.background import Background
from megacore.errors import UserError

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
            try:
                h = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise UserError(f"{file}: not a readable safetensors file ({e})", str(self.root)) from None
            self._files[file] = h
        return h

    def _get(self, file: str, key: str, src: tuple[slice, ...]) -> torch.Tensor:
        """`src` of tensor `key` in `file`, reading only those bytes (0-d tensors have no slice)."""
        handle = self._handle(file)
        try:
            return handle.get_slice(key)[src] if src else handle.get_tensor(key)
        except SafetensorError as e:
            raise UserError(f"{file}: no tensor {key!r} ({e})", str(self.root)) from None

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
