"""A run that heals itself: one run under `mega-train --nproc-per-node 2 --max-restarts 5` (tp 2,
asynchronous saves every 4 steps) in which a random worker is SIGKILLed at three random steps, a
random worker is SIGSTOPped once (a hang: the other's watchdog writes its stacks and exits 3) and one
save fails with an injected write error. It must finish every step with losses and final weights
bitwise equal to an uninterrupted run, each failure costing exactly one restart (a restart that
failed would show as one more), and print its timeline. Marked slow (`make test-slow`): about
two minutes, 30 s of them torchrun's agent waiting out its grace before it kills the stopped
worker. `MEGA_CHAOS_SEED` replays a seed (the timeline names it).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, assert_bitwise_equal
from mega_train.launch import children
from runlib import checkpoint_tensors, metrics, worker_rank, write_run

STEPS, EVERY, HANG_S, FAILED_SAVE = 48, 4, 6, 8
WATCHED = ("resuming from", "restart ", "stopped responding", "warning", "blocked outside Python")


def settings() -> dict:
    return {
        "train_steps": STEPS, "checkpoint": {"every": EVERY, "async": True}, "eval": {"every": 0},
        "logging": {"every": 1}, "parallel": {"tp": 2}, "watchdog": {"hang_s": HANG_S},
    }  # fmt: skip


def launch(run_json: Path, log: Path, inject: str = "", restarts: int = 0) -> subprocess.Popen:
    cmd = [str(BIN / "mega-train"), "--nproc-per-node", "2", "--max-restarts", str(restarts)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_TRAIN_INJECT": inject}
    return subprocess.Popen(
        [*cmd, "--manifest", str(run_json)], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def plan(rng: random.Random) -> list[tuple[str, int, int]]:
    """Three kills and a stop at random steps (after the failed save, 5 apart at least, so each
    lands in a start that made progress), each on a random rank."""
    while True:
        steps = sorted(rng.sample(range(FAILED_SAVE + 2, STEPS - 6), 4))
        if min(b - a for a, b in itertools.pairwise(steps)) >= 5:
            break
    return [(kind, step, rng.randrange(2)) for kind, step in zip(["kill"] * 3 + ["stop"], steps, strict=True)]


class Chaos:
    """The run, the faults done to it, and its timeline (seconds since launch)."""

    def __init__(self, run_json: Path, log: Path) -> None:
        self.out, self.log = run_json.parent / "run", log
        self.proc = launch(run_json, log, f"fail-save@{FAILED_SAVE}/s0", restarts=5)
        self.t0, self.seen, self.timeline = time.monotonic(), 0, []

    def note(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.t0:6.1f} s  {what}")

    def poll(self) -> int:
        """The newest step in metrics.jsonl, the log's new lines of interest noted."""
        lines = self.log.read_text().splitlines()
        for line in lines[self.seen :]:
            if any(w in line for w in WATCHED):
                self.note(line)
        self.seen = len(lines)
        rows = metrics(self.out) if (self.out / "metrics.jsonl").is_file() else []
        return rows[-1]["step"] if rows else 0

    def at(self, kind: str, step: int, rank: int) -> None:
        """At `step` (or after), SIGKILL or SIGSTOP the worker of `rank`."""
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.failure()
            workers = children(self.proc.pid)
            if self.poll() >= step and len(workers) == 2:
                break
            time.sleep(0.05)
        pid = next(p for p in workers if worker_rank(p) == rank)
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        self.note(f"{'SIGKILL' if kind == 'kill' else 'SIGSTOP'} rank {rank} at step {self.poll()}")

    def finish(self) -> int:
        while self.proc.poll() is None:
            assert time.monotonic() - self.t0 < 600, self.failure()
            self.poll()
            time.sleep(0.1)
        self.poll()
        self.note(f"launcher exited {self.proc.returncode}")
        return self.proc.returncode

    def failure(self) -> str:
        return "\n".join([*self.timeline, self.log.read_text()[-3000:]])


@pytest.mark.slow
def test_a_run_killed_stopped_and_failing_a_save_heals_itself_bit_identical(
    tmp_path: Path, tokens: Path
) -> None:
    seed = int(os.environ.get("MEGA_CHAOS_SEED") or random.randrange(10**6))
    faults = plan(random.Random(seed))
    run_json = write_run(tmp_path / "chaos", tokens, **settings())
    chaos = Chaos(run_json, tmp_path / "chaos.log")
    chaos.note(f"seed {seed}: {', '.join(f'{k} rank {r} at step {s}' for k, s, r in faults)}")
    try:
        for kind, step, rank in faults:
            chaos.at(kind, step, rank)
        code = chaos.finish()
    finally:
        if chaos.proc.poll() is None:
            os.killpg(chaos.proc.pid, signal.SIGKILL)
    print("\n".join(chaos.timeline))
    log = chaos.log.read_text()
    assert code == 0, chaos.failure()
    # Four failures, four restarts: none needed a second attempt.
    assert re.findall(r"\(restart (\d) of 5\)", log) == ["1", "2", "3", "4"], chaos.failure()
    assert len(re.findall(r"mega-train: resuming from ", log)) == 4, chaos.failure()
    assert log.count("No space left on device (injected)") == 1, chaos.failure()
    stopped = faults[-1][2]
    assert f"rank {stopped} stopped responding" in log, chaos.failure()
    (hang,) = (chaos.out / "hangs").iterdir()
    assert (hang / f"rank-{1 - stopped:05d}.txt").read_text().count("File ") > 3

    reference = write_run(tmp_path / "reference", tokens, **settings())
    assert launch(reference, tmp_path / "reference.log").wait(timeout=300) == 0
    want_out = reference.parent / "run"
    assert [r["loss"] for r in metrics(chaos.out)] == [r["loss"] for r in metrics(want_out)]
    name = f"checkpoints/step-{STEPS:08d}"
    got, want = checkpoint_tensors(chaos.out / name), checkpoint_tensors(want_out / name)
    for key in want:
        assert_bitwise_equal(got[key], want[key], key)
