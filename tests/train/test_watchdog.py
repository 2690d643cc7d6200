"""The hang watchdog (mega_train.watchdog): a rank stuck mid-step turns into an exit soon after
hang_s, one line naming it and the Python stacks in out/hangs/<time>/rank-NNNNN.txt; a worker
SIGSTOPped under `mega-train --nproc-per-node 2` is named as the rank that stopped responding, and
the job ends (torchrun's agent kills the stopped worker after its 30 s grace: `make test-slow`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN
from mega_train.launch import children
from runlib import train, worker_rank, write_run

HANG_S = 6


def watched_run(tmp_path: Path, tokens: Path) -> Path:
    return write_run(
        tmp_path, tokens, train_steps=100000, checkpoint={"every": 100000}, eval={"every": 0},
        watchdog={"hang_s": HANG_S},
    )  # fmt: skip


def test_a_rank_stuck_in_a_step_is_named_and_its_stacks_are_written(tmp_path: Path, tokens: Path) -> None:
    start = time.monotonic()
    proc = train(watched_run(tmp_path, tokens), env={"MEGA_TRAIN_INJECT": "hang@5"})
    assert proc.returncode == 3 and time.monotonic() - start < HANG_S + 60
    line = "rank 0 stopped progressing after step 4 (no step for 6 s: hang_s); stacks in"
    assert line in proc.stderr, proc.stderr
    (hang,) = (tmp_path / "run" / "hangs").iterdir()
    stacks = (hang / "rank-00000.txt").read_text()
    assert "rank 0: no progress for 6 s after step 4" in stacks and "after_backward" in stacks


@pytest.mark.slow
def test_a_stopped_worker_is_named_and_the_others_stacks_are_written(tmp_path: Path, tokens: Path) -> None:
    run_json = watched_run(tmp_path, tokens)
    out = run_json.parent / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "mega-train"), "--nproc-per-node", "2", "--manifest", str(run_json)]
    log = (tmp_path / "stdout.txt").open("w")  # a pipe nobody reads would fill and block the run
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (
            not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3
        ):
            assert time.monotonic() < deadline and proc.poll() is None, "no steps"
            time.sleep(0.1)
        workers = children(proc.pid)
        assert len(workers) == 2
        stopped = workers[1]
        rank = worker_rank(stopped)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        _, err = proc.communicate(timeout=HANG_S + 90)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert took < HANG_S + 60, took
    lines = [line for line in err.splitlines() if "stopped responding" in line]
    assert len(lines) == 1 and f"rank {rank} stopped responding" in lines[0], err
    (hang,) = (out / "hangs").iterdir()
    other = 1 - rank
    stacks = (hang / f"rank-{other:05d}.txt").read_text()
    assert f"rank {other}: no progress for {HANG_S} s" in stacks and "File " in stacks
    assert not (hang / f"rank-{rank:05d}.txt").exists()  # a stopped process writes nothing
