"""Preference pairs as training rows: a pair's chosen and rejected sequences in adjacent rows.

A preference source (`mega-tokenize --format preference`) holds every pair as two adjacent
documents, chosen first, its completion's tokens marked with their own role code. A split is a
range of whole pairs (`pair_range`: no split separates a pair's sides). Each epoch shuffles the
split's pairs on its own, from `np.random.default_rng([seed, source_id, split_id, epoch])` as
`packing.py` does, so the first N rows are the same however many are asked for; row 2i holds the
chosen and row 2i + 1 the rejected side of the i-th pair, each alone in its row (padding after it,
positions from 0). A pair with a side longer than a row (`seq_length + 1` tokens) is left out,
never cut: cutting would drop the completion the objective compares (`skipped` counts them, for a
warning).

Packed (`PackedPairIndex`, the run's `"packing": "pack"`): each row holds as many whole pairs as fit,
greedily in the shuffled order, a pair's chosen side then its rejected side, each from position 0 (so
every side attends only to itself); the batch then counts rows, and the pairs per row vary. A pair
whose two sides together are longer than a row is left out. `slots` is what the engine sums a row's
log-probabilities into: one per side, for the row that holds the most pairs.
"""

from __future__ import annotations

import numpy as np

from megacore.data.documents import Documents
from megacore.data.packing import PAD, PAD_ROLE, document_row, pack_starts
from megacore.data.samples import SPLITS, SplitIndex, split_lengths, split_ranges
from megacore.errors import UserError


def pair_range(n_docs: int, fractions: list[float], split_id: int) -> tuple[int, int]:
    """The documents of split `split_id` of a preference source of `n_docs` documents: the split's
    share of the pairs, two documents each."""
    first, last = split_ranges(n_docs // 2, fractions)[split_id]
    return 2 * first, 2 * last


class PairIndex(SplitIndex):
    """The rows of one split of one preference source. Array `order`: every epoch's shuffled pairs
    (positions among the split's pairs), epoch after epoch, as many as the rows need."""

    ARRAYS = ("order",)

    def __init__(
        self,
        docs: Documents,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        order: np.ndarray,
    ) -> None:
        super().__init__(docs, doc_range, seq_length, num_samples)
        self.order = order
        lengths = docs.lengths[doc_range[0] : doc_range[1]]
        self.skipped = int((np.maximum(lengths[0::2], lengths[1::2]) > seq_length + 1).sum())
        self.slots = 1  # a row holds one side

    @classmethod
    def build(
        cls,
        docs: Documents,
        doc_range: tuple[int, int],
        *,
        split_id: int,
        seq_length: int,
        num_samples: int,
        seed: int,
        source_id: int = 0,
        where: str | None = None,
    ) -> PairIndex:
        """Shuffle as many epochs of the pairs that fit a row as `num_samples` rows (even) need."""
        fit = _fitting(docs, doc_range, split_id, seq_length, np.maximum, "has a side", where)
        pairs = -(-num_samples // 2)
        orders, epoch = [], 0
        while sum(map(len, orders)) < pairs:
            orders.append(fit[_shuffle(len(fit), seed, source_id, split_id, epoch)])
            epoch += 1
        return cls(docs, doc_range, seq_length, num_samples, np.concatenate(orders)[:pairs])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Row i: int64 tokens [seq_length + 1] (PAD after the sequence), their uint8 role codes
        (PAD_ROLE there) or None, and int64 positions from 0."""
        self._check(i)
        pair, side = divmod(int(i), 2)
        return document_row(self.docs, self.first_doc + 2 * int(self.order[pair]) + side, self.seq_length)


class PackedPairIndex(SplitIndex):
    """The rows of one split of one preference source, whole pairs packed (module docstring).
    Arrays: `order` (every epoch's shuffled pairs that fit a row, epoch after epoch) and `starts`
    (row i holds the pairs `order[starts[i]:starts[i + 1]]`)."""

    ARRAYS = ("order", "starts")

    def __init__(
        self,
        docs: Documents,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        order: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        super().__init__(docs, doc_range, seq_length, num_samples)
        self.order, self.starts = order, starts
        lengths = docs.lengths[doc_range[0] : doc_range[1]]
        self.skipped = int((lengths[0::2] + lengths[1::2] > seq_length + 1).sum())
        self.slots = 2 * int(np.diff(starts).max())

    @classmethod
    def build(
        cls,
        docs: Documents,
        doc_range: tuple[int, int],
        *,
        split_id: int,
        seq_length: int,
        num_samples: int,
        seed: int,
        source_id: int = 0,
        where: str | None = None,
    ) -> PackedPairIndex:
        """Shuffle and pack epochs of the pairs that fit a row until there are `num_samples` rows."""
        fit = _fitting(
            docs, doc_range, split_id, seq_length, np.add, "(chosen and rejected together) is", where
        )
        lengths = docs.lengths[doc_range[0] : doc_range[1]]
        pair_lengths = (lengths[0::2] + lengths[1::2])[fit]
        orders, starts, done, epoch = [], [np.zeros(1, np.int64)], 0, 0
        while done < num_samples:
            order = _shuffle(len(fit), seed, source_id, split_id, epoch)
            bounds = pack_starts(pair_lengths[order], seq_length + 1)
            starts.append(bounds[1:] + epoch * len(fit))
            orders.append(fit[order])
            done += len(bounds) - 1
            epoch += 1
        starts = np.concatenate(starts)[: num_samples + 1]
        return cls(docs, doc_range, seq_length, num_samples, np.concatenate(orders), starts)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Row i: int64 tokens [seq_length + 1] (PAD after the pairs), their uint8 role codes (PAD_ROLE
        there) or None, and int64 positions from 0 in each side."""
        self._check(i)
        n = self.seq_length + 1
        tokens = np.full(n, PAD, dtype=np.int64)
        roles = np.full(n, PAD_ROLE, dtype=np.uint8) if self.docs.has_roles else None
        positions = np.empty(n, dtype=np.int64)
        done = 0
        for pair in self.order[self.starts[i] : self.starts[i + 1]]:
            for doc in (self.first_doc + 2 * int(pair), self.first_doc + 2 * int(pair) + 1):
                length = int(self.docs.lengths[doc])
                tokens[done : done + length] = self.docs.tokens(doc)
                if roles is not None:
                    roles[done : done + length] = self.docs.roles(doc)
                positions[done : done + length] = np.arange(length)
                done += length
        positions[done:] = np.arange(n - done)
        return tokens, roles, positions


def _fitting(
    docs: Documents,
    doc_range: tuple[int, int],
    split_id: int,
    seq_length: int,
    size: np.ufunc,
    what: str,
    where: str | None,
) -> np.ndarray:
    """The split's pairs (positions among its pairs) whose `size` (the longer side, or both sides
    together) fits a row of `seq_length + 1` tokens; none is bad input."""
    if len(docs) % 2:
        raise UserError(f"{docs.path} holds {len(docs)} documents: not whole pairs", where)
    lengths = split_lengths(docs, doc_range, split_id, where)
    fit = np.flatnonzero(size(lengths[0::2], lengths[1::2]) <= seq_length + 1)
    if len(fit) == 0:
        raise UserError(
            f"every pair of the {SPLITS[split_id]} split of {docs.path} {what} longer than "
            f"seq_length + 1 = {seq_length + 1} tokens",
            where,
        )
    return fit


def _shuffle(n: int, seed: int, source_id: int, split_id: int, epoch: int) -> np.ndarray:
    """One epoch's order of n pairs, from its own generator (as `packing.py` draws documents')."""
    return np.random.default_rng([seed % 2**64, source_id, split_id, epoch]).permutation(n)
