"""The blended dataset the trainer reads: `Dataset.build(...)`, then `ds[i]` or `ds.batch(a, b)`.

The blend (`blend.py`) says how many samples each source gives, then each source's split is
indexed for exactly the epochs that takes: a small source starts new epochs while a big one is
still in its first. A text source gives GPT samples (`samples.py`), a chat source whole
conversations (`packing.py`, `pack` (their default) or `pad`), a preference source its pairs' two
sides in adjacent rows (`pairs.py`; a blend of preference sources counts rows, and every source's
share is whole pairs: even numbers of rows, `blend_index` over pairs), or with `pack` whole pairs
packed into each row (`PackedPairIndex`), a prompts source one prompt a sample (`prompts.py`: with
room for `completion_length` tokens after it; a batch then says which document each sample is).

Building is cheap but not free (a permutation per epoch of every source), and every process of a
job needs the same index, so with a `cache_dir` the arrays are saved once as `.npy` files in
`<cache_dir>/<which>-<key16>/`, where the key hashes everything the index depends on. Processes
of a job may build concurrently without a barrier: each writes a temporary sibling directory and
renames it into place, and the loser of the race discards its own. A directory only ever appears
complete, so a crash leaves at most a temporary directory, never a half index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal, NamedTuple

import numpy as np

from megacore.artifacts.manifest import TokensManifest
from megacore.artifacts.reader import read_manifest_bytes
from megacore.data.blend import blend_index
from megacore.data.documents import Documents
from megacore.data.packing import PackedIndex, Packing
from megacore.data.pairs import PackedPairIndex, PairIndex, pair_range
from megacore.data.prompts import PromptIndex
from megacore.data.samples import SPLITS, SampleIndex, split_ranges

INDEX_VERSION = 2  # bump when the index arrays or how they are built change: old caches are rebuilt
MARKER = "megacore-index.json"  # in every cache directory this code wrote, and only there

Split = Literal["train", "valid", "test"]


class Batch(NamedTuple):
    """Samples stacked: int64 tokens [B, S+1], uint8 roles [B, S+1] or None, int64 positions
    [B, S+1] (each document counted from 0) or None (no document masking); for prompts, each
    sample's source and global document id [B, 2]."""

    tokens: np.ndarray
    roles: np.ndarray | None
    positions: np.ndarray | None
    documents: np.ndarray | None = None


class Dataset:
    """Blended samples: `ds[i]` is (int64 tokens [S+1], uint8 roles [S+1] or None, int64 positions
    [S+1] or None).

    Roles come back only when every source has a roles sidecar: a batch mixing labelled and
    unlabelled samples would have no single meaning for "assistant tokens only". Positions come back
    when documents are masked from each other: with `doc_mask`, or when a source is packed (chat);
    a text source's samples then count positions from 0 in each document only with `doc_mask`."""

    def __init__(
        self,
        sources: list[SampleIndex | PackedIndex | PairIndex | PackedPairIndex | PromptIndex],
        source_ids: np.ndarray,
        source_samples: np.ndarray,
        doc_mask: bool = False,
    ) -> None:
        self.sources = sources
        self.source_ids, self.source_samples = source_ids, source_samples
        self.has_roles = bool(sources) and all(s.docs.has_roles for s in sources)
        self.doc_mask = doc_mask
        self.has_positions = doc_mask or any(not isinstance(s, SampleIndex) for s in sources)
        # Conversations longer than a sample, cut to it (a packed source's split).
        self.truncated = sum(s.truncated for s in sources if isinstance(s, PackedIndex))
        # Pairs with a side longer than a row, left out (a preference source's split).
        pairs = [s for s in sources if isinstance(s, PairIndex | PackedPairIndex)]
        self.skipped_pairs = sum(s.skipped for s in pairs)
        # The most sides a row holds (1 unpacked): what the engine sums log-probabilities into.
        self.pair_slots = max((s.slots for s in pairs), default=1)
        # Prompts too long to leave room for a completion, left out (a prompts source's split).
        self.prompts = any(isinstance(s, PromptIndex) for s in sources)
        self.skipped_prompts = sum(s.skipped for s in sources if isinstance(s, PromptIndex))

    @classmethod
    def build(
        cls,
        sources: list[tuple[Path, TokensManifest, float]],
        split: list[float],
        which: Split,
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: Path | None = None,
        packing: Packing | None = None,
        doc_mask: bool = False,
        completion_length: int = 0,
    ) -> Dataset:
        """Index `num_samples` samples of the `which` split of the sources (path, manifest, weight),
        loading the index from `cache_dir` when it holds one built from the same inputs. Chat
        sources are packed unless `packing` is `pad`, preference sources only if it is `pack`;
        `doc_mask` masks the documents of text samples apart; prompts leave `completion_length`
        tokens of room."""
        split_id = SPLITS.index(which)
        packed = [m.format == "chat" for _, m, _ in sources]
        paired = [m.format == "preference" for _, m, _ in sources]
        prompts = [m.format == "prompts" for _, m, _ in sources]
        pack_pairs = packing == "pack"
        packing = packing or "pack"
        docs, manifest_shas = _documents(sources)
        ranges = [_split(len(d), split, split_id, p) for d, p in zip(docs, paired, strict=True)]
        key = _cache_key(
            sources=[[sha, w] for sha, (_, _, w) in zip(manifest_shas, sources, strict=True)],
            split=split,
            which=which,
            seq_length=seq_length,
            num_samples=num_samples,
            seed=seed,
            packing=[
                packing if p else ("packed pairs" if pack_pairs else "pairs") if q else None
                for p, q in zip(packed, paired, strict=True)
            ],
            **({"completion_length": completion_length} if any(prompts) else {}),
        )
        target = cache_dir / f"{which}-{key[:16]}" if cache_dir is not None else None
        kinds = _kinds(packed, paired, pack_pairs, prompts)
        extra = {PackedIndex: {"packing": packing}, PromptIndex: {"completion_length": completion_length}}
        if target is not None and (target / MARKER).is_file():
            arrays = {p.stem: np.load(p, mmap_mode="r") for p in target.glob("*.npy")}
            ds = cls._from_arrays(docs, ranges, seq_length, arrays, kinds, doc_mask, completion_length)
        else:
            weights = [w for _, _, w in sources]
            source_ids, source_samples = _blend(weights, num_samples, any(paired) and not pack_pairs)
            needed = np.bincount(source_ids, minlength=len(sources))
            indexes = [
                _build_index(kind, d, r, split_id, seq_length, int(n), seed, j, extra.get(kind, {}))
                for j, (kind, d, r, n) in enumerate(zip(kinds, docs, ranges, needed, strict=True))
            ]
            ds = cls(indexes, source_ids, source_samples, doc_mask)
            if target is not None:
                _save(target, key, ds.arrays())
        if cache_dir is not None:
            _remove_stale(cache_dir, which, keep=target)
        return ds

    @classmethod
    def _from_arrays(
        cls,
        docs: list[Documents],
        ranges: list[tuple[int, int]],
        seq_length: int,
        arrays: dict,
        kinds: list[type],
        doc_mask: bool,
        completion_length: int,
    ) -> Dataset:
        source_ids, source_samples = arrays["blend_source_ids"], arrays["blend_source_samples"]
        needed = np.bincount(source_ids, minlength=len(docs))
        indexes = []
        for j, (d, r, n, kind) in enumerate(zip(docs, ranges, needed, kinds, strict=True)):
            kw = {k: arrays[f"source{j}_{k}"] for k in kind.ARRAYS}
            if kind is PromptIndex:
                kw["completion_length"] = completion_length
            indexes.append(kind(d, r, seq_length, int(n), **kw))
        return cls(indexes, source_ids, source_samples, doc_mask)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every index array by file name: the blend's, then each source's per-epoch arrays."""
        out = {"blend_source_ids": self.source_ids, "blend_source_samples": self.source_samples}
        for j, s in enumerate(self.sources):
            out.update({f"source{j}_{k}": a for k, a in s.arrays().items()})
        return out

    def __len__(self) -> int:
        return len(self.source_ids)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (0..{len(self) - 1})")
        source = self.sources[int(self.source_ids[i])]
        tokens, roles, positions = source.sample(int(self.source_samples[i]))
        if not self.has_positions:
            positions = None
        elif isinstance(source, SampleIndex) and not self.doc_mask:
            positions = np.arange(len(tokens))  # one sequence, as without document masking
        return tokens, roles if self.has_roles else None, positions

    def batch(self, start: int, stop: int) -> Batch:
        """Samples start..stop-1 stacked."""
        samples = [self[i] for i in range(start, stop)]
        if not samples:
            raise IndexError(f"empty batch {start}..{stop}")
        tokens, roles, positions = zip(*samples, strict=True)
        return Batch(
            np.stack(tokens),
            np.stack(roles) if self.has_roles else None,
            np.stack(positions) if self.has_positions else None,
            self._documents(start, stop) if self.prompts else None,
        )

    def _documents(self, start: int, stop: int) -> np.ndarray:
        """Each prompt sample's source and global document id, [stop - start, 2]."""
        out = np.empty((stop - start, 2), dtype=np.int64)
        for row, i in enumerate(range(start, stop)):
            j = int(self.source_ids[i])
            out[row] = j, self.sources[j].document(int(self.source_samples[i]))
        return out


def _documents(sources: list[tuple[Path, TokensManifest, float]]) -> tuple[list[Documents], list[str]]:
    """Each source's documents, and its manifest's sha256 (what the index cache's key holds)."""
    docs, shas = [], []
    for path, manifest, _ in sources:
        root, data = read_manifest_bytes(Path(path))
        docs.append(Documents(root, manifest))
        shas.append(hashlib.sha256(data).hexdigest())
    return docs, shas


def _kinds(packed: list[bool], paired: list[bool], pack_pairs: bool, prompts: list[bool]) -> list[type]:
    """Each source's index class."""
    pairs = PackedPairIndex if pack_pairs else PairIndex
    return [
        PromptIndex if r else pairs if q else PackedIndex if p else SampleIndex
        for p, q, r in zip(packed, paired, prompts, strict=True)
    ]


def _build_index(
    kind: type,
    docs: Documents,
    doc_range: tuple[int, int],
    split_id: int,
    seq_length: int,
    num_samples: int,
    seed: int,
    source_id: int,
    kw: dict,
) -> SampleIndex | PackedIndex | PairIndex | PackedPairIndex | PromptIndex:
    """Source `source_id`'s index of its split (`kind` from `_kinds`, `kw` its own settings)."""
    return kind.build(
        docs, doc_range, split_id=split_id, seq_length=seq_length, num_samples=num_samples, seed=seed,
        source_id=source_id, where=f"$.data.sources[{source_id}]", **kw,
    )  # fmt: skip


def _split(n_docs: int, fractions: list[float], split_id: int, paired: bool) -> tuple[int, int]:
    """The documents of a source's split: by pairs for a preference source."""
    return pair_range(n_docs, fractions, split_id) if paired else split_ranges(n_docs, fractions)[split_id]


def _blend(weights: list[float], num_samples: int, pairs: bool) -> tuple[np.ndarray, np.ndarray]:
    """`blend_index`'s source of every sample and its number in that source; over pairs (each
    source's rows 2k and 2k + 1 together) when the samples are rows of pairs."""
    if not pairs:
        return blend_index(weights, num_samples)
    ids, nums = blend_index(weights, -(-num_samples // 2))
    rows = np.stack([2 * nums, 2 * nums + 1], 1).reshape(-1)
    return np.repeat(ids, 2)[:num_samples], rows[:num_samples]


def _cache_key(**inputs: object) -> str:
    """sha256 over everything the index depends on, and the index format version."""
    blob = json.dumps({"index_version": INDEX_VERSION, **inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _save(target: Path, key: str, arrays: dict[str, np.ndarray]) -> None:
    """Write the arrays into a temporary sibling, marker last, then rename it into place; when
    another process of the job got there first, keep theirs (the same bytes) and drop ours."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        for name, a in arrays.items():
            _write_synced(tmp / f"{name}.npy", lambda f, a=a: np.save(f, a))
        _write_synced(tmp / MARKER, lambda f: f.write(json.dumps({"key": key}).encode() + b"\n"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale(cache_dir: Path, which: str, keep: Path | None) -> None:
    """Remove this split's index directories for other keys: only names `<which>-<16 hex>` that
    hold our marker, so nothing else anyone put in `cache_dir` is touched."""
    pattern = re.compile(rf"{re.escape(which)}-[0-9a-f]{{16}}")
    if not cache_dir.is_dir():
        return
    for d in cache_dir.iterdir():
        if d == keep or not pattern.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        if (d / MARKER).is_file():
            shutil.rmtree(d, ignore_errors=True)
