"""GPT training samples of one source's split: document splits, per-epoch shuffles, sample lookup.

As Megatron's GPTDataset: the split's documents are concatenated (the EOS between documents is in
the tokens already) and cut into samples of `seq_length + 1` tokens that overlap by one token (the
inputs are tokens[:-1], the labels tokens[1:]). Unlike Megatron, each epoch is shuffled on its own,
from `np.random.default_rng([seed, source_id, split_id, epoch])`, so the first N samples are the
same however many are asked for: a run extended with more steps keeps the samples it has seen.

Per epoch the index holds three arrays, built with numpy (no Python loop per document or sample):
the document order, the cumulative token offsets in that order, and the sample order.
"""

from __future__ import annotations

import numpy as np

from megacore.data.documents import Documents
from megacore.errors import UserError

SPLITS = ("train", "valid", "test")


def split_ranges(n_docs: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges for train, valid and test (always three; missing fractions are 0).

    The fractions are normalised to sum 1 and their running sums rounded to whole documents, so the
    ranges tile 0..n_docs exactly, whatever the rounding of each."""
    if not 1 <= len(fractions) <= len(SPLITS) or min(fractions) < 0 or not sum(fractions) > 0:
        raise ValueError(f"split {fractions}: 1 to 3 non-negative fractions, not all zero")
    f = np.zeros(len(SPLITS))
    f[: len(fractions)] = fractions
    bounds = np.floor(np.cumsum(f / f.sum()) * n_docs + 0.5).astype(np.int64)
    bounds[-1] = n_docs
    edges = [0, *(int(b) for b in bounds)]
    return [(edges[i], edges[i + 1]) for i in range(len(SPLITS))]


class SplitIndex:
    """What an index of one source's split holds besides its arrays: the documents, where the
    split starts among them, the sample length and count. A subclass names its arrays in ARRAYS:
    what `arrays` returns for the index cache, and what `__init__` takes after these."""

    ARRAYS: tuple[str, ...] = ()

    def __init__(
        self, docs: Documents, doc_range: tuple[int, int], seq_length: int, num_samples: int
    ) -> None:
        self.docs = docs
        self.first_doc = doc_range[0]
        self.seq_length = seq_length
        self.num_samples = num_samples

    def arrays(self) -> dict[str, np.ndarray]:
        """What `__init__` takes besides the documents: what an index cache saves."""
        return {name: getattr(self, name) for name in self.ARRAYS}

    def __len__(self) -> int:
        return self.num_samples

    def _check(self, i: int) -> None:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range (0..{self.num_samples - 1})")


def split_lengths(
    docs: Documents, doc_range: tuple[int, int], split_id: int, where: str | None
) -> np.ndarray:
    """The token counts of the split's documents; a split without any is a UserError naming `where`
    (the source's place in the run manifest) and the split."""
    lengths = docs.lengths[doc_range[0] : doc_range[1]]
    if len(lengths) == 0:
        name = f"the {SPLITS[split_id]} split of {docs.path}"
        raise UserError(f"{name} holds no documents (of {len(docs)} in all); change the split", where)
    return lengths


class SampleIndex(SplitIndex):
    """The samples of one split of one source: sample i is epoch `i // samples_per_epoch`.

    Sample k of an epoch covers tokens [k * seq_length, k * seq_length + seq_length + 1) of that
    epoch's concatenation, so `samples_per_epoch = (tokens - 1) // seq_length` and an epoch's
    samples hold every token but the last partial sample's once as an input. Arrays, one row per
    epoch: `doc_order` (positions in the split's range), `offsets` (where each of those documents
    starts in the concatenation, and the total) and `sample_order` (which k is the epoch's j-th).
    """

    ARRAYS = ("doc_order", "offsets", "sample_order")

    def __init__(
        self,
        docs: Documents,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        doc_order: np.ndarray,
        offsets: np.ndarray,
        sample_order: np.ndarray,
    ) -> None:
        super().__init__(docs, doc_range, seq_length, num_samples)
        self.samples_per_epoch = sample_order.shape[1]
        self.doc_order, self.offsets, self.sample_order = doc_order, offsets, sample_order

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
    ) -> SampleIndex:
        """Shuffle as many epochs as `num_samples` needs. A split too small for one sample is a
        UserError naming `where` (the source's place in the run manifest) and the split."""
        lengths = split_lengths(docs, doc_range, split_id, where)
        total = int(lengths.sum())
        name = f"the {SPLITS[split_id]} split of {docs.path}"
        if total < seq_length + 1:
            raise UserError(
                f"{name} holds {total} tokens, fewer than seq_length + 1 = {seq_length + 1}", where
            )
        per_epoch = (total - 1) // seq_length
        epochs = -(-num_samples // per_epoch)
        doc_dtype = np.int32 if len(lengths) < 2**31 else np.int64
        doc_order = np.empty((epochs, len(lengths)), dtype=doc_dtype)
        offsets = np.zeros((epochs, len(lengths) + 1), dtype=np.int64)
        sample_order = np.empty((epochs, per_epoch), dtype=np.int64)
        for e in range(epochs):
            rng = np.random.default_rng([seed % 2**64, source_id, split_id, e])
            doc_order[e] = rng.permutation(len(lengths))
            np.cumsum(lengths[doc_order[e]], out=offsets[e, 1:])
            sample_order[e] = rng.permutation(per_epoch)
        return cls(docs, doc_range, seq_length, num_samples, doc_order, offsets, sample_order)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Sample i: int64 tokens [seq_length + 1], their uint8 role codes or None, and int64
        positions counted from 0 in each document (the first, maybe a document's middle, too):
        what document masking (`Decoder` positions) needs."""
        self._check(i)
        epoch, k = divmod(int(i), self.samples_per_epoch)
        start = int(self.sample_order[epoch, k]) * self.seq_length
        offsets, order = self.offsets[epoch], self.doc_order[epoch]
        pos = int(np.searchsorted(offsets, start, side="right")) - 1
        tokens = np.empty(self.seq_length + 1, dtype=np.int64)
        roles = np.empty(self.seq_length + 1, dtype=np.uint8) if self.docs.has_roles else None
        positions = np.empty(self.seq_length + 1, dtype=np.int64)
        done = 0
        while done < len(tokens):  # the few documents this sample spans
            doc, offset = self.first_doc + int(order[pos]), start + done - int(offsets[pos])
            take = min(len(tokens) - done, int(offsets[pos + 1]) - start - done)
            tokens[done : done + take] = self.docs.tokens(doc, offset, take)
            if roles is not None:
                roles[done : done + take] = self.docs.roles(doc, offset, take)
            positions[done : done + take] = np.arange(take)
            done, pos = done + take, pos + 1
        return tokens, roles, positions
