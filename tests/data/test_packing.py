"""Whole documents per sample (megacore.data.packing): `pack` and `pad` on real tokens artifacts,
checked against the documents themselves; the targets that train on the assistant's tokens only."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from datalib import S, lengths, make_tokens
from megacore.data.documents import Documents
from megacore.data.packing import IGNORE, PAD, PAD_ROLE, PackedIndex, inputs_and_targets, pack_starts


def build(docs: Documents, packing: str, n: int, seed: int = 7) -> PackedIndex:
    return PackedIndex.build(
        docs, (0, len(docs)), packing=packing, split_id=0, seq_length=S, num_samples=n, seed=seed
    )


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_samples_hold_whole_documents_in_each_epochs_order(tmp_path: Path, packing: str) -> None:
    sizes = lengths(1, 30, high=S + 6)  # some longer than a sample (S + 1): cut to it
    path, m, want = make_tokens(tmp_path / "t", [sizes[:12], sizes[12:]], roles=True)
    docs = Documents(path, m)
    index = build(docs, packing, 60)  # more than one epoch
    assert index.truncated == sum(n > S + 1 for n in sizes)
    per_sample: list[list[int]] = []
    for i in range(len(index)):
        tokens, roles, positions = index.sample(i)
        assert tokens.shape == roles.shape == positions.shape == (S + 1,)
        # Split the sample back into documents at position 0; each is a document's first tokens.
        cuts = [*np.flatnonzero(positions == 0), S + 1]
        parts = [tokens[a:b] for a, b in itertools.pairwise(cuts)]
        real = [p for p in parts if p[0] != PAD]
        pads = [p for p in parts if p[0] == PAD]
        assert len(pads) <= 1 and all((p == PAD).all() for p in pads)
        if packing == "pad":
            assert len(real) == 1
        per_sample.append(
            [
                next(
                    k
                    for k, doc in enumerate(want)
                    if doc[: len(p)] == p.tolist() and len(p) == min(len(doc), S + 1)
                )
                for p in real
            ]
        )
        assert ((roles == PAD_ROLE) == (tokens == PAD)).all()
        assert (roles[tokens != PAD] == tokens[tokens != PAD] % 5).all()  # make_tokens' role codes
    # Every document once per epoch, in that epoch's order.
    n_docs, seen = len(want), [d for docs_ in per_sample for d in docs_]
    order = index.order.reshape(-1, n_docs)
    assert seen[: 2 * n_docs] == [*order[0].tolist(), *order[1].tolist()]
    if packing == "pack":  # greedy: within an epoch, the next sample's first document did not fit
        for i in range(len(per_sample) - 1):
            if index.starts[i + 1] % n_docs:
                fill = sum(min(len(want[d]), S + 1) for d in per_sample[i])
                assert fill + min(len(want[per_sample[i + 1][0]]), S + 1) > S + 1, i


def test_prefix_stable_and_seeded(tmp_path: Path) -> None:
    path, m, _ = make_tokens(tmp_path / "t", [lengths(2, 40, high=S)])
    docs = Documents(path, m)
    short, long = build(docs, "pack", 10), build(docs, "pack", 50)
    for i in range(10):
        assert all((a == b).all() for a, b in zip(short.sample(i)[::2], long.sample(i)[::2], strict=True))
    other = build(docs, "pack", 10, seed=8)
    assert any((short.sample(i)[0] != other.sample(i)[0]).any() for i in range(10))


def test_pack_starts_greedy() -> None:
    assert pack_starts(np.array([3, 4, 2, 5, 1]), 7).tolist() == [0, 2, 4, 5]
    assert pack_starts(np.array([7, 7]), 7).tolist() == [0, 1, 2]


def test_targets_train_on_the_assistant_inside_each_document() -> None:
    # Two documents and padding: user (1) then assistant (3) tokens.
    tokens = np.array([10, 11, 12, 13, 20, 21, 22, PAD, PAD])
    roles = np.array([1, 1, 3, 3, 1, 3, 3, PAD_ROLE, PAD_ROLE], dtype=np.uint8)
    positions = np.array([0, 1, 2, 3, 0, 1, 2, 0, 1])
    x, pos, y = inputs_and_targets(tokens, positions, roles, train_role=3)
    assert x.tolist() == [10, 11, 12, 13, 20, 21, 22, 0]
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert y.tolist() == [IGNORE, 12, 13, IGNORE, 21, 22, IGNORE, IGNORE]
    _, _, y_all = inputs_and_targets(tokens, positions)
    assert y_all.tolist() == [11, 12, 13, IGNORE, 21, 22, IGNORE, IGNORE]
