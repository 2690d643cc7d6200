"""MMIDIDX shards: our writer and megatron-core's builder produce the same bytes, and each side
reads what the other wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets import indexed_dataset  # required: a broken install fails, never skips

from megacore.data.indexed import IndexedReader, IndexedWriter, token_dtype
from megacore.errors import UserError


def _docs(seed: int, n: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 50))) for _ in range(n)]


@pytest.mark.parametrize(("dtype", "high"), [("uint16", 65536), ("int32", 200_000)])
def test_same_bytes_as_megatron_builder_and_read_back(tmp_path: Path, dtype: str, high: int):
    docs = _docs(0, 101, high)
    ours = IndexedWriter(tmp_path / "ours", dtype)
    ours.FLUSH_BYTES = 16  # every add() starts a background flush: the bytes must not change
    # Several add() calls with many documents each, the way the tokenizer writes.
    for chunk in (docs[:1], docs[1:40], docs[40:40], docs[40:]):
        lengths = np.array([len(d) for d in chunk], dtype=np.int64)
        flat = np.concatenate(chunk) if chunk else np.zeros(0, np.int64)
        ours.add(flat, lengths)
    ours.close()

    b = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=getattr(np, dtype))
    for d in docs:
        b.add_item(torch.from_numpy(d.astype(np.int64)))
        b.end_document()
    b.finalize(str(tmp_path / "theirs.idx"))

    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes(), ext

    ds = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    assert len(ds) == len(docs)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    mine = IndexedReader(tmp_path / "theirs")
    assert mine.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
        assert np.array_equal(mine[i], d)
        assert ds[i].dtype == np.dtype(dtype)
    assert np.array_equal(mine.get(3, 2, 4), docs[3][2:6])


def test_token_dtype_is_uint16_only_when_ids_fit():
    assert token_dtype(32000) == "uint16"
    assert token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "int32"
    assert token_dtype(128256) == "int32"


def test_writer_refuses_ids_that_do_not_fit(tmp_path: Path):
    w = IndexedWriter(tmp_path / "x", "uint16")
    with pytest.raises(ValueError, match="does not fit"):
        w.add(np.array([70000], dtype=np.int64), np.array([1]))
    w.abort()


def test_reader_rejects_bad_files(tmp_path: Path):
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(UserError, match="bad header"):
        IndexedReader(tmp_path / "bad")
    w = IndexedWriter(tmp_path / "ok", "uint16")
    w.add(np.arange(10), np.array([4, 6]))
    w.close()
    (tmp_path / "ok.bin").write_bytes((tmp_path / "ok.bin").read_bytes()[:-2])
    with pytest.raises(UserError, match="index says 10"):
        IndexedReader(tmp_path / "ok")
    with pytest.raises(UserError, match="missing"):
        IndexedReader(tmp_path / "nothing")
