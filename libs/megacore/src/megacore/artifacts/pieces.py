"""Pieces and boxes: the pure arithmetic of the tensor layout algebra (no torch).

A logical tensor (global shape, dtype) is held by pieces `{file, key, offset, shape}`; a box is an
(offset, shape) rectangle of it. Splitting a shape into boxes, intersecting boxes and checking
that pieces tile a tensor exactly are all the layout needs to decide what to read or write
(tensors.py does the reading and writing).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path

from megacore.artifacts.manifest import Piece, TensorEntry
from megacore.errors import UserError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)
SAFETENSORS_CODES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "uint16": "U16",
    "uint8": "U8",
}


def whole(shape: Sequence[int]) -> Box:
    return (0,) * len(shape), tuple(shape)


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


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (key -> dtype, shape, offsets): 8 bytes and the JSON."""
    return safetensors_layout(path)[1]


def safetensors_layout(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts (its `data_offsets` count from there) and its header."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"not a readable safetensors file ({e})", str(path)) from None
    if not isinstance(header, dict):
        raise UserError("not a readable safetensors file (header is not an object)", str(path))
    return 8 + n, header


def check_pieces(tensors: dict[str, TensorEntry], root: Path, where: str) -> None:
    """Every piece names a tensor of its file with the entry's dtype and the piece's shape, and the
    pieces of each tensor tile it exactly: what a reader relies on, from the file headers alone."""
    headers: dict[str, dict] = {}
    for name, entry in tensors.items():
        at = f'{where}: $.tensors["{name}"]'
        for piece in entry.pieces:
            if piece.file not in headers:
                headers[piece.file] = safetensors_header(root / piece.file)
            info = headers[piece.file].get(piece.key)
            if not isinstance(info, dict):
                raise UserError(f"piece {piece.key!r} is not a tensor of {piece.file}", at)
            if info.get("dtype") != SAFETENSORS_CODES.get(entry.dtype) or info.get("shape") != piece.shape:
                raise UserError(
                    f"piece {piece.key!r} in {piece.file} is {info.get('dtype')} {info.get('shape')}, the "
                    f"manifest says {entry.dtype} {piece.shape}",
                    at,
                )
        try:
            piece_entry(entry.shape, entry.dtype, entry.pieces)
        except ValueError as e:
            raise UserError(f"the pieces do not tile the tensor ({e})", at) from None
