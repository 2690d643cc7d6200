"""Stragglers (mega_train.stragglers): every rank's own work per step lands in metrics.jsonl at the
log steps, and a rank slowed as a slow device would be (the `slow` fault: 50 ms more of its update
from step 3 on) is named on the console from the first log step whose interval it slowed, and no
other rank, nor the same rank before it slowed; which ranks are peers under a pipeline, worked out
by hand."""

from __future__ import annotations

from pathlib import Path

from mega_train.stragglers import stragglers
from runlib import metrics, ok, torchrun, write_run


def test_a_slowed_rank_is_named_and_every_ranks_time_is_recorded(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(
        tmp_path, tokens, train_steps=8, checkpoint={"every": 8}, eval={"every": 0}, logging={"every": 2}
    )
    out = ok(torchrun(2, run_json, env={"MEGA_TRAIN_INJECT": "slow@3/r1"})).stdout
    named = [line for line in out.splitlines() if " is slow: " in line]
    assert [line.split(":")[1] for line in named] == [" step 4", " step 6", " step 8"], out
    assert all("rank 1 is slow: its own work (batch and update) took" in line for line in named)
    records = metrics(tmp_path / "run")
    assert [len(r["rank_local_s"]) for r in records] == [2] * 8
    for r in records:
        fast, slow = r["rank_local_s"]
        if r["step"] >= 3:
            assert slow >= 0.05 and slow > fast, r  # the injected 50 ms are part of it
        elif r["step"] > 1:  # the same work on both (the first allocates AdamW's moments, 0.1 s)
            assert abs(slow - fast) < 0.03, r


def test_peers_are_the_ranks_of_the_same_stage_where_there_are_several() -> None:
    def gathered(stages: list[int], seconds: list[float]) -> list[list[float]]:
        return [[s, t, t, t] for s, t in zip(stages, seconds, strict=True)]

    # pp 2 x dp 2: stage 0 holds the embeddings, its updates twice stage 1's: nobody is slow.
    assert stragglers(gathered([0, 0, 1, 1], [0.2, 0.2, 0.1, 0.1])) == []
    # rank 3 takes 0.16 s against its stage peer's 0.1 s: 1.6x > 1.5x, and 60 ms more.
    assert stragglers(gathered([0, 0, 1, 1], [0.2, 0.2, 0.1, 0.16])) == [(3, 0.16, 0.1)]
    # pp 2 alone: no peer in its stage, so the other ranks: 0.2 s against 0.1 s.
    assert stragglers(gathered([0, 1], [0.2, 0.1])) == [(0, 0.2, 0.1)]
    # 1.6x but only 3 ms more: scheduling noise, nobody named.
    assert stragglers(gathered([0, 0], [0.008, 0.005])) == []
    # one slow step of three is no straggler: the median step counts.
    assert stragglers([[0, 0.1, 0.1, 0.1], [0, 0.1, 0.9, 0.1]]) == []
