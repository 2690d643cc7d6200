"""Context parallel's split of a sequence (megacore.parallel.cp), against positions worked out by hand:
each cp rank holds one early and one late chunk, so every rank's causal attention work is equal."""

from __future__ import annotations

import torch

from megacore.parallel.cp import local_indices, shard_sequence, unshard_sequence

# S = 8 at cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
BY_HAND = {(2, 0): [0, 1, 6, 7], (2, 1): [2, 3, 4, 5]}
# cp 4: chunks of 1 token; rank r holds tokens r and 7 - r.
BY_HAND |= {(4, r): [r, 7 - r] for r in range(4)}


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    row = torch.arange(8)[None] * 10  # [1, 8]: token values 0, 10, ..., 70
    for (cp, rank), want in BY_HAND.items():
        assert local_indices(8, cp, rank).tolist() == want
        assert shard_sequence(row, cp, rank)[0].tolist() == [10 * i for i in want]


def test_the_parts_put_back_together_are_the_sequence() -> None:
    x = torch.randn(3, 16, 2)
    for cp in (1, 2, 4, 8):
        parts = torch.cat([shard_sequence(x, cp, r) for r in range(cp)])  # an all-gather's order
        assert torch.equal(unshard_sequence(parts, cp), x)


def test_causal_work_is_the_same_on_every_rank() -> None:
    """Keys a rank's queries see under the causal mask: sum over its tokens i of (i + 1)."""
    for cp in (2, 4):
        work = {sum(i + 1 for i in local_indices(64, cp, r).tolist()) for r in range(cp)}
        assert len(work) == 1, work
