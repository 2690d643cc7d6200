"""Megatron `MMIDIDX` token shards: a streaming `.bin/.idx` writer and a memory-mapped reader.

The format is megatron-core's `IndexedDataset` (megatron/core/datasets/indexed_dataset.py), so
shards written here are read by Megatron-LM unchanged, and shards Megatron wrote are read here:

    .idx  b"MMIDIDX\\x00\\x00"  version <Q=1>  dtype code <B>  sequence count <Q>  document count <Q>
          sequence lengths int32[seqs]  sequence byte pointers int64[seqs]  document indices int64[docs]
    .bin  the tokens of every sequence, back to back, in the dtype of the .idx

One sequence per document here (no sentence splitting), so the document indices are 0..n.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from megacore.background import Background
from megacore.errors import UserError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes.
DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits (vocab <= 65536), else int32: half the disk and page cache."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedWriter:
    """Appends documents to `<prefix>.bin` and writes `<prefix>.idx` on `close`.

    `add(flat, lengths)` takes many documents at once (their tokens back to back and each one's
    length), so no Python work is done per document. The .bin sha256 is computed while writing.
    Memory: 8 bytes per document for the lengths; the tokens go straight to disk. Every
    `FLUSH_BYTES` written, a background thread flushes them to the device (skipped while it is
    still busy with the previous ones), so the artifact's final fsync does not wait for the whole
    file.
    """

    FLUSH_BYTES = 64 << 20

    def __init__(self, prefix: str | Path, dtype: str) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._bin = open(bin_path(prefix), "wb")  # noqa: SIM115 - closed in close()
        self._lengths: list[np.ndarray] = []
        self._sha = hashlib.sha256()
        self.documents = 0
        self.tokens = 0
        self.bin_sha256: str | None = None
        self.idx_sha256: str | None = None
        self._unflushed = 0
        self._flusher: Background | None = None

    def _flush_behind(self) -> None:
        """Queue an fdatasync of what is written so far, unless one is already waiting."""
        if self._flusher is None:
            self._flusher = Background.sink(_fdatasync_quiet, depth=1, name="mega-flush")
        self._bin.flush()
        if self._flusher.offer(self._bin.fileno()):
            self._unflushed = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `flat` holds their tokens concatenated, `lengths` each one's count."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(flat):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(flat)} tokens were given")
        if flat.dtype != self.dtype and len(flat) and int(flat.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(flat.max())} does not fit {self.dtype}")
        data = np.ascontiguousarray(flat, dtype=self.dtype)
        buf = memoryview(data).cast("B")
        self._bin.write(buf)
        self._sha.update(buf)
        self._unflushed += len(buf)
        if self._unflushed >= self.FLUSH_BYTES:
            self._flush_behind()
        self._lengths.append(lengths.astype(np.int32))
        self.documents += len(lengths)
        self.tokens += len(flat)

    def close(self) -> None:
        """Finish the .bin and write the .idx (megatron-core's layout, byte for byte)."""
        self._join_flusher()
        self._bin.close()
        self.bin_sha256 = self._sha.hexdigest()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)
        head = (
            INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[self.dtype.name])
        )
        head += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
        sha = hashlib.sha256()
        with open(idx_path(self.prefix), "wb") as f:
            for part in (head, lengths.tobytes(), pointers.tobytes(), doc_idx.tobytes()):
                f.write(part)
                sha.update(part)
        self.idx_sha256 = sha.hexdigest()

    def abort(self) -> None:
        self._join_flusher()
        if not self._bin.closed:
            self._bin.close()

    def _join_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.close()  # the fd must stay open until its fdatasync returns


def _fdatasync_quiet(fd: int) -> None:
    # Only a head start: the artifact's commit fsyncs the file and reports any error.
    with contextlib.suppress(OSError):
        os.fdatasync(fd)


class IndexedReader:
    """Memory-mapped view of a `<prefix>.bin/.idx` pair: `reader[i]` is document i's tokens.

    Reads only the header eagerly; lengths, pointers and tokens are views into the mapped files.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise UserError("missing token shard file", str(p))
        idx = np.memmap(ip, dtype=np.uint8, mode="r")
        fixed = len(INDEX_HEADER) + 8 + 1 + 8 + 8
        if len(idx) < fixed or bytes(idx[: len(INDEX_HEADER)]) != INDEX_HEADER:
            raise UserError("not a Megatron MMIDIDX index (bad header)", str(ip))
        off = len(INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", idx, off)
        (code,) = struct.unpack_from("<B", idx, off + 8)
        seqs, docs = struct.unpack_from("<QQ", idx, off + 9)
        if version != INDEX_VERSION or code not in CODE_DTYPES:
            raise UserError(f"unsupported MMIDIDX version {version} or dtype code {code}", str(ip))
        if len(idx) < fixed + seqs * 4 + seqs * 8 + docs * 8:
            raise UserError("index file is truncated", str(ip))
        self.dtype = np.dtype(CODE_DTYPES[code])
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=seqs, offset=fixed)
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=seqs, offset=fixed + seqs * 4)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=docs, offset=fixed + seqs * 12)
        self._idx = idx
        self._bin = (
            np.memmap(bp, dtype=self.dtype, mode="r") if bp.stat().st_size else np.zeros(0, self.dtype)
        )
        expected = int(self.sequence_lengths.astype(np.int64).sum())
        if len(self._bin) != expected:
            raise UserError(f"data file holds {len(self._bin)} tokens, the index says {expected}", str(bp))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Part of document i: `length` tokens from `offset` (what a sample builder needs)."""
        doc = self[i]
        return doc[offset:] if length is None else doc[offset : offset + length]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the shard, back to back (a view, nothing is read until used)."""
        return self._bin
