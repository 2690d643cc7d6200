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
"""

from __future__ import annotations

import numpy as np

from megacore.data.documents import Documents
from megacore.data.packing import PAD, PAD_ROLE
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
        if len(docs) % 2:
            raise UserError(f"{docs.path} holds {len(docs)} documents: not whole pairs", where)
        lengths = split_lengths(docs, doc_range, split_id, where)
        fit = np.flatnonzero(np.maximum(lengths[0::2], lengths[1::2]) <= seq_length + 1)
        if len(fit) == 0:
            raise UserError(
                f"every pair of the {SPLITS[split_id]} split of {docs.path} has a side longer than "
                f"seq_length + 1 = {seq_length + 1} tokens",
                where,
            )
        pairs = -(-num_samples // 2)
        orders, epoch = [], 0
        while sum(map(len, orders)) < pairs:
            rng = np.random.default_rng([seed % 2**64, source_id, split_id, epoch])
            orders.append(fit[rng.permutation(len(fit))])
            epoch += 1
        return cls(docs, doc_range, seq_length, num_samples, np.concatenate(orders)[:pairs])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Row i: int64 tokens [seq_length + 1] (PAD after the sequence), their uint8 role codes
        (PAD_ROLE there) or None, and int64 positions from 0."""
        self._check(i)
        pair, side = divmod(int(i), 2)
        doc = self.first_doc + 2 * int(self.order[pair]) + side
        n, length = self.seq_length + 1, int(self.docs.lengths[doc])
        tokens = np.full(n, PAD, dtype=np.int64)
        tokens[:length] = self.docs.tokens(doc)
        roles = None
        if self.docs.has_roles:
            roles = np.full(n, PAD_ROLE, dtype=np.uint8)
            roles[:length] = self.docs.roles(doc)
        positions = np.concatenate([np.arange(length), np.arange(n - length)])
        return tokens, roles, positions
