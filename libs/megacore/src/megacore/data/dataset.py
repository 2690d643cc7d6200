"""The blended dataset the trainer reads: `Dataset.build(...)`, then `ds[i]` or `ds.batch(a, b)`.

The blend (`blend.py`) says how many samples each source gives, then each source's split is
indexed (`samples.py`) for exactly the epochs that takes: a small source starts new epochs while
a big one is still in its first.

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
from typing import BinaryIO, Literal

import numpy as np

from megacore.artifacts.manifest import TokensManifest
from megacore.artifacts.reader import read_manifest_bytes
from megacore.data.blend import blend_index
from megacore.data.documents import Documents
from megacore.data.samples import SPLITS, SampleIndex, split_ranges

INDEX_VERSION = 1  # bump when the index arrays or how they are built change: old caches are rebuilt
MARKER = "megacore-index.json"  # in every cache directory this code wrote, and only there

Split = Literal["train", "valid", "test"]


class Dataset:
    """Blended GPT samples: `ds[i]` is (int64 tokens [S+1], uint8 roles [S+1] or None).

    Roles come back only when every source has a roles sidecar: a batch mixing labelled and
    unlabelled samples would have no single meaning for "assistant tokens only"."""

    def __init__(
        self, sources: list[SampleIndex], source_ids: np.ndarray, source_samples: np.ndarray
    ) -> None:
        self.sources = sources
        self.source_ids, self.source_samples = source_ids, source_samples
        self.has_roles = bool(sources) and all(s.docs.has_roles for s in sources)

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
    ) -> Dataset:
        """Index `num_samples` samples of the `which` split of the sources (path, manifest, weight),
        loading the index from `cache_dir` when it holds one built from the same inputs."""
        split_id = SPLITS.index(which)
        docs, manifest_shas = [], []
        for path, manifest, _ in sources:
            root, data = read_manifest_bytes(Path(path))
            docs.append(Documents(root, manifest))
            manifest_shas.append(hashlib.sha256(data).hexdigest())
        ranges = [split_ranges(len(d), split)[split_id] for d in docs]
        key = _cache_key(
            sources=[[sha, w] for sha, (_, _, w) in zip(manifest_shas, sources, strict=True)],
            split=split,
            which=which,
            seq_length=seq_length,
            num_samples=num_samples,
            seed=seed,
        )
        target = cache_dir / f"{which}-{key[:16]}" if cache_dir is not None else None
        if target is not None and (target / MARKER).is_file():
            arrays = {p.stem: np.load(p, mmap_mode="r") for p in target.glob("*.npy")}
            ds = cls._from_arrays(docs, ranges, seq_length, arrays)
        else:
            source_ids, source_samples = blend_index([w for _, _, w in sources], num_samples)
            needed = np.bincount(source_ids, minlength=len(sources))
            indexes = [
                SampleIndex.build(
                    d,
                    r,
                    split_id=split_id,
                    seq_length=seq_length,
                    num_samples=int(n),
                    seed=seed,
                    source_id=j,
                    where=f"$.data.sources[{j}]",
                )
                for j, (d, r, n) in enumerate(zip(docs, ranges, needed, strict=True))
            ]
            ds = cls(indexes, source_ids, source_samples)
            if target is not None:
                _save(target, key, ds.arrays())
        if cache_dir is not None:
            _remove_stale(cache_dir, which, keep=target)
        return ds

    @classmethod
    def _from_arrays(
        cls, docs: list[Documents], ranges: list[tuple[int, int]], seq_length: int, arrays: dict
    ) -> Dataset:
        source_ids, source_samples = arrays["blend_source_ids"], arrays["blend_source_samples"]
        needed = np.bincount(source_ids, minlength=len(docs))
        indexes = [
            SampleIndex(d, r, seq_length, int(n), **{k: arrays[f"source{j}_{k}"] for k in SampleIndex.ARRAYS})
            for j, (d, r, n) in enumerate(zip(docs, ranges, needed, strict=True))
        ]
        return cls(indexes, source_ids, source_samples)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every index array by file name: the blend's, then each source's per-epoch arrays."""
        out = {"blend_source_ids": self.source_ids, "blend_source_samples": self.source_samples}
        for j, s in enumerate(self.sources):
            out.update({f"source{j}_{k}": a for k, a in s.arrays().items()})
        return out

    def __len__(self) -> int:
        return len(self.source_ids)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (0..{len(self) - 1})")
        tokens, roles = self.sources[int(self.source_ids[i])].sample(int(self.source_samples[i]))
        return tokens, roles if self.has_roles else None

    def batch(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Samples start..stop-1 stacked: int64 [B, S+1] and uint8 roles [B, S+1], or None."""
        samples = [self[i] for i in range(start, stop)]
        if not samples:
            raise IndexError(f"empty batch {start}..{stop}")
        tokens = np.stack([t for t, _ in samples])
        return tokens, np.stack([r for _, r in samples]) if self.has_roles else None


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
