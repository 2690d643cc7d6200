"""Whole documents per sample, for chat fine-tuning: `pack` and `pad`, and the targets they train on.

GPT samples (`samples.py`) cut the concatenated documents anywhere; a conversation cut in two loses
the context its assistant turn answers. Here a sample of `seq_length + 1` slots holds whole
documents in the epoch's shuffled order:
- `pack`: greedily, a document that does not fit in what is left starts the next sample;
- `pad`: one document per sample.
A document longer than a sample is cut to it (`truncated` counts them, for a warning); the rest of a
sample is padding (token PAD). Positions count from 0 in each document and in the padding, which is
what the model's `positions` input needs to keep attention and RoPE inside each document.

Each epoch is shuffled on its own from `np.random.default_rng([seed, source_id, split_id, epoch])`
and packed in that order, so the first N samples are the same however many are asked for. The
greedy pass is one Python loop over an epoch's documents (about a second per million).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from megacore.data.documents import Documents
from megacore.data.samples import SplitIndex, split_lengths

Packing = Literal["pack", "pad"]
PAD = -1  # a padding slot in a sample's tokens (and its role code is PAD_ROLE)
PAD_ROLE = 255
IGNORE = -100  # a target that is not trained on: F.cross_entropy's ignore_index, the fused loss's too


class PackedIndex(SplitIndex):
    """The samples of one split of one source, whole documents each.

    Arrays: `order` (every epoch's shuffled document positions in the split, epoch after epoch) and
    `starts` (sample i holds the documents `order[starts[i]:starts[i + 1]]`)."""

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
        self.truncated = int((lengths > seq_length + 1).sum())  # documents of the split cut short

    @classmethod
    def build(
        cls,
        docs: Documents,
        doc_range: tuple[int, int],
        *,
        packing: Packing,
        split_id: int,
        seq_length: int,
        num_samples: int,
        seed: int,
        source_id: int = 0,
        where: str | None = None,
    ) -> PackedIndex:
        """Shuffle and pack epochs until there are `num_samples` samples."""
        lengths = np.minimum(split_lengths(docs, doc_range, split_id, where), seq_length + 1)
        orders, starts, done, epoch = [], [np.zeros(1, np.int64)], 0, 0
        while done < num_samples:
            rng = np.random.default_rng([seed % 2**64, source_id, split_id, epoch])
            order = rng.permutation(len(lengths))
            if packing == "pack":
                bounds = pack_starts(lengths[order], seq_length + 1)
            else:
                bounds = np.arange(len(order) + 1)
            starts.append(bounds[1:] + epoch * len(lengths))  # in `order` over all epochs
            orders.append(order)
            done += len(bounds) - 1
            epoch += 1
        return cls(
            docs,
            doc_range,
            seq_length,
            num_samples,
            np.concatenate(orders),
            np.concatenate(starts)[: num_samples + 1],
        )

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Sample i: int64 tokens [seq_length + 1] (PAD in the padding), their uint8 role codes
        (PAD_ROLE in the padding) or None, and int64 positions (from 0 in each document)."""
        self._check(i)
        n = self.seq_length + 1
        tokens = np.full(n, PAD, dtype=np.int64)
        roles = np.full(n, PAD_ROLE, dtype=np.uint8) if self.docs.has_roles else None
        positions = np.empty(n, dtype=np.int64)
        done = 0
        for pos in self.order[self.starts[i] : self.starts[i + 1]]:
            doc = self.first_doc + int(pos)
            take = min(int(self.docs.lengths[doc]), n - done)
            tokens[done : done + take] = self.docs.tokens(doc, 0, take)
            if roles is not None:
                roles[done : done + take] = self.docs.roles(doc, 0, take)
            positions[done : done + take] = np.arange(take)
            done += take
        positions[done:] = np.arange(n - done)
        return tokens, roles, positions


def document_row(
    docs: Documents, doc: int, seq_length: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Document `doc` alone in a row of `seq_length` + 1: int64 tokens (PAD after it), their uint8
    role codes (PAD_ROLE there) or None, and int64 positions from 0 (a preference side, a prompt)."""
    n, length = seq_length + 1, int(docs.lengths[doc])
    tokens = np.full(n, PAD, dtype=np.int64)
    tokens[:length] = docs.tokens(doc)
    roles = None
    if docs.has_roles:
        roles = np.full(n, PAD_ROLE, dtype=np.uint8)
        roles[:length] = docs.roles(doc)
    return tokens, roles, np.concatenate([np.arange(length), np.arange(n - length)])


def pack_starts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Greedy packing in order: where each sample's first document is (indices into `lengths`), and
    len(lengths) at the end. Every length is at most `capacity`."""
    starts, fill = [0], 0
    for j, length in enumerate(lengths.tolist()):
        if fill + length > capacity:
            starts.append(j)
            fill = 0
        fill += length
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def inputs_and_targets(
    tokens: np.ndarray, positions: np.ndarray, roles: np.ndarray | None = None, train_role: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Model inputs [..., S], positions [..., S] and targets [..., S] from samples [..., S + 1]:
    a target is IGNORE where it is padding, where it starts another document (the last token of a
    document predicts nothing) and, given `train_role`, where its role code is another one (loss on
    the assistant's tokens only). Padding inputs become token 0 (attended by nothing but padding)."""
    inputs = np.where(tokens[..., :-1] == PAD, 0, tokens[..., :-1])
    targets = tokens[..., 1:].copy()
    ignore = (targets == PAD) | (positions[..., 1:] == 0)
    if train_role is not None:
        if roles is None:
            raise ValueError("a train_role needs the role codes")
        ignore |= roles[..., 1:] != train_role
    targets[ignore] = IGNORE
    return inputs, positions[..., :-1], targets
