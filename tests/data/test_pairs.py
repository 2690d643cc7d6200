"""Packed preference pairs (megacore.data.pairs.PackedPairIndex) on a real tokens artifact, checked
against its documents: each row whole pairs, chosen then rejected, every fitting pair once per epoch
in that epoch's order, packed greedily; pairs longer than a row left out."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from datalib import S, lengths, make_tokens
from megacore.data.documents import Documents
from megacore.data.packing import PAD
from megacore.data.pairs import PackedPairIndex


def test_rows_hold_whole_pairs_greedily_in_each_epochs_order(tmp_path: Path) -> None:
    sizes = lengths(3, 40, high=6)  # 20 pairs, several to a row
    sizes[6:8] = [S, 3]  # pair 3: its sides fit a row apart, not together
    sizes[20:22] = [S - 4, 5]  # pair 10: exactly a row
    path, m, want = make_tokens(tmp_path / "t", [sizes[:16], sizes[16:]])
    index = PackedPairIndex.build(
        Documents(path, m), (0, len(want)), split_id=0, seq_length=S, num_samples=40, seed=5
    )
    pair_len = [len(want[2 * p]) + len(want[2 * p + 1]) for p in range(len(want) // 2)]
    fitting = [p for p, n in enumerate(pair_len) if n <= S + 1]
    assert index.skipped == len(pair_len) - len(fitting) > 0
    rows: list[list[int]] = []
    for i in range(len(index)):
        tokens, roles, positions = index.sample(i)
        assert roles is None and tokens.shape == positions.shape == (S + 1,)
        cuts = [*np.flatnonzero(positions == 0), S + 1]
        parts = [tokens[a:b].tolist() for a, b in itertools.pairwise(cuts)]
        if parts[-1][0] == PAD:  # the padding after the pairs: one stretch, to the end
            assert set(parts.pop()) == {PAD}
        sides = [want.index(p) for p in parts]  # each part a whole document
        assert sides[0::2] == [s - 1 for s in sides[1::2]] and all(s % 2 == 0 for s in sides[0::2])
        rows.append([s // 2 for s in sides[0::2]])
    assert index.slots == 2 * max(map(len, rows))
    # Every fitting pair once per epoch, in that epoch's order, the epochs' orders differing.
    seen = [p for row in rows for p in row]
    n = len(fitting)
    epochs = [seen[k * n : (k + 1) * n] for k in range(len(seen) // n)]
    assert len(epochs) >= 2 and epochs[0] != epochs[1]
    assert all(sorted(e) == fitting for e in epochs)
    # Greedy: a row ends where the next pair of its epoch would not fit.
    done = 0
    for row, following in itertools.pairwise(rows):
        done += len(row)
        if done % n:
            assert sum(pair_len[p] for p in row) + pair_len[following[0]] > S + 1
