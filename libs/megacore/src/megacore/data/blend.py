"""Deterministic blending of data sources by weight: which source, and which of its samples, each
global sample is.

No randomness is needed: with normalised weights w_j, the c-th sample of source j is scheduled at
time (c + 0.5) / w_j and all sources are merged by time (a stable sort, so ties go to the lower
source id). Every prefix then draws each source in proportion to its weight (within 1 sample of
n * w_j for up to three sources; with more, a source can stray slightly further), and the schedule
is one fixed infinite order, so the first N of a longer blend are a blend of N.
"""

from __future__ import annotations

import numpy as np


def blend_index(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `num_samples` global samples: its source id (int16) and its index within that
    source (int64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 1 <= len(w) <= np.iinfo(np.int16).max or not (w > 0).all():
        raise ValueError(f"weights {weights}: 1 or more positive numbers")
    w = w / w.sum()
    # The n-th sample is scheduled by time n + k/2 (k sources: each has at most half a sample
    # pending), so these many candidates of each source always hold its share of the first n.
    counts = np.ceil((num_samples + len(w) / 2) * w).astype(np.int64) + 2
    times = np.concatenate([(np.arange(c) + 0.5) / wj for c, wj in zip(counts, w, strict=True)])
    sources = np.repeat(np.arange(len(w), dtype=np.int16), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.argsort(times, kind="stable")[:num_samples]
    source_ids = sources[order]
    return source_ids, order - first[source_ids]
