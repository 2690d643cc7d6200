"""Property tests of the layout algebra: any slice from any set of pieces, exactly."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_bitwise_equal
from megacore.artifacts import (
    TORCH_DTYPES,
    Box,
    Piece,
    SafetensorsStreamWriter,
    TensorReader,
    chunk_split,
    even_split,
    intersect,
    piece_entry,
)
from megacore.artifacts.header import FileEntry

DTYPES = ["float32", "bfloat16", "int32", "uint16"]


def sub_box(box, inner):
    """`inner` is relative to `box`: the same box in global coordinates."""
    return tuple(a + b for a, b in zip(box[0], inner[0], strict=True)), inner[1]


def _tensor(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (
        torch.randint(0, 60000, shape, generator=g)
        if dtype in ("int32", "uint16")
        else torch.randn(shape, generator=g)
    )
    return t.to(TORCH_DTYPES[dtype])


def _slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))]


@st.composite
def layouts(draw, shape: tuple[int, ...]) -> list[Box]:
    """A random layout as Megatron/torchtitan would make it: an optional even TP split on dim 0 or
    1, then an optional uneven FSDP-style dim-0 chunking of each block."""
    boxes: list[Box] = [((0,) * len(shape), shape)]
    dims = [d for d in range(min(2, len(shape)))]
    if dims and draw(st.booleans()):
        d = draw(st.sampled_from(dims))
        parts = draw(st.sampled_from([p for p in range(1, 9) if shape[d] % p == 0]))
        boxes = [sub_box(boxes[0], b) for b in even_split(shape, d, parts)]
    if dims and draw(st.booleans()):
        k = draw(st.integers(1, 5))
        boxes = [sub_box(b, c) for b in boxes for c in chunk_split(b[1], 0, k)]
    return boxes


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=rank, max_size=rank)))
    src = draw(layouts(shape))
    dst = draw(layouts(shape))
    files = draw(st.integers(1, 3))  # pipeline placement: pieces spread over several files
    placement = [draw(st.integers(0, files - 1)) for _ in src]
    dtype = draw(st.sampled_from(DTYPES))
    off = tuple(draw(st.integers(0, n - 1)) for n in shape)
    box = (off, tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True)))
    return shape, src, dst, placement, dtype, box, draw(st.integers(0, 2**31))


def _write(
    root: Path, t: torch.Tensor, dtype: str, boxes: list[Box], placement: list[int]
) -> tuple[list[Piece], list[FileEntry]]:
    """The pieces, and the files as a manifest lists them (the reader checks each against it)."""
    by_file: dict[str, list[tuple[str, Box]]] = defaultdict(list)
    for i, (box, f) in enumerate(zip(boxes, placement, strict=True)):
        by_file[f"stage{f}.safetensors"].append((f"w.{i}", box))
    pieces, files = [], []
    for file, items in by_file.items():
        with SafetensorsStreamWriter(root / file, [(k, dtype, b[1]) for k, b in items]) as w:
            for key, box in items:
                w.write(key, _slice(t, box))
                pieces.append(Piece(file=file, key=key, offset=list(box[0]), shape=list(box[1])))
        files.append(FileEntry(path=file, size=w.size, sha256=w.close()))
    return pieces, files


@settings(max_examples=150, deadline=None)
@given(cases())
def test_any_slice_from_any_layout(case):
    shape, src, dst, placement, dtype, box, seed = case
    t = _tensor(shape, dtype, seed)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        pieces, files = _write(root, t, dtype, src, placement)
        entry = piece_entry(shape, dtype, pieces)
        with TensorReader(root, files) as r:
            assert_bitwise_equal(r.read("w", entry), t)
            assert_bitwise_equal(r.read("w", entry, box), _slice(t, box).contiguous())
            # Re-layout: every target block assembled from the source pieces tiles the tensor exactly.
            out = torch.zeros_like(t)
            for b in dst:
                block = r.read("w", entry, b)
                assert_bitwise_equal(block, _slice(t, b).contiguous())
                out[tuple(slice(o, o + s) for o, s in zip(*b, strict=True))] = block
            assert_bitwise_equal(out, t)


def test_chunk_split_matches_torch_chunk_and_keeps_empty_ranks():
    boxes = chunk_split((5, 3), 0, 4)  # torch.chunk(5 rows, 4) -> 2, 2, 1, and an empty 4th rank
    assert [b[1][0] for b in boxes] == [2, 2, 1, 0]
    t = torch.arange(15).reshape(5, 3)
    for b, c in zip(boxes, torch.chunk(t, 4), strict=False):
        assert torch.equal(_slice(t, b), c)


def test_even_split_refuses_uneven():
    with pytest.raises(ValueError, match="does not divide"):
        even_split((6, 4), 1, 3)


def test_piece_entry_refuses_gaps_and_overlaps():
    p = lambda off, shp: Piece(file="f", key="k", offset=off, shape=shp)  # noqa: E731
    with pytest.raises(ValueError, match="overlap"):
        piece_entry([4], "float32", [p([0], [3]), p([2], [1])])
    with pytest.raises(ValueError, match="hold 3 elements"):
        piece_entry([4], "float32", [p([0], [3])])
    assert intersect(((0,), (2,)), ((2,), (2,))) is None
