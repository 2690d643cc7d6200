"""In-job restarts: under `mega-train --nproc-per-node 2 --max-restarts 1` a worker SIGKILLed mid-run
is started again with the other, on the first attempt (each start's process group keeps its keys
apart in torchrun's store), resumes from the newest checkpoint and ends bit-identical to an
uninterrupted run; a worker blocked in a collective whose peer is stopped exits within 2 s of a
SIGTERM instead of ignoring it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from helpers import BIN, assert_bitwise_equal
from mega_train.launch import children
from runlib import checkpoint_tensors, metrics, ok, write_run

STEPS = 40
SETTINGS = {"train_steps": STEPS, "checkpoint": {"every": 8}, "eval": {"every": 0}}


def start(run_json: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [str(BIN / "mega-train"), "--nproc-per-node", "2", *extra, "--manifest", str(run_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(metrics(out)) < n if (out / "metrics.jsonl").is_file() else True:
        assert time.monotonic() < deadline and proc.poll() is None, "the run did not get there"
        time.sleep(0.05)


def test_a_killed_worker_is_restarted_in_the_job_and_the_run_ends_bit_identical(
    tmp_path: Path, tokens: Path
) -> None:
    reference = write_run(tmp_path / "reference", tokens, **SETTINGS)
    run_json = write_run(tmp_path / "restarted", tokens, **SETTINGS)
    out = run_json.parent / "run"
    proc = start(run_json, tmp_path / "log.txt", "--max-restarts", "1")
    try:
        wait_for_steps(out, proc, 12)
        os.kill(children(proc.pid)[1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "log.txt").read_text()
    (resumed,) = re.findall(r"mega-train: resuming from \S+ \(step (\d+) of 40\)", log)
    assert re.findall(r"\(restart (\d+) of (\d+)\)", log) == [("1", "1")], log[-3000:]
    assert int(resumed) >= 8, log[-3000:]
    ok(
        subprocess.run(
            [BIN / "mega-train", "--nproc-per-node", "2", "--manifest", reference],
            capture_output=True,
            text=True,
        )
    )
    name = f"checkpoints/step-{STEPS:08d}"
    got, want = checkpoint_tensors(out / name), checkpoint_tensors(reference.parent / "run" / name)
    for key in want:
        assert_bitwise_equal(got[key], want[key], key)
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, STEPS + 1))  # metrics.jsonl cut back to the resumed step


def test_a_worker_blocked_in_a_collective_exits_within_2_s_of_sigterm(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(
        tmp_path, tokens, train_steps=100000, checkpoint={"every": 100000}, eval={"every": 0}
    )
    proc = start(run_json, tmp_path / "log.txt")
    workers: tuple[int, ...] = ()
    try:
        wait_for_steps(run_json.parent / "run", proc, 3)
        workers = blocked, stopped = children(proc.pid)
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(2)  # the other is now waiting for it in the step's collectives
        os.kill(blocked, signal.SIGTERM)
        sent = time.monotonic()
        while (
            Path(f"/proc/{blocked}").exists() and Path(f"/proc/{blocked}/stat").read_text().split()[2] != "Z"
        ):
            assert time.monotonic() - sent < 10, "SIGTERM ignored"
            time.sleep(0.02)
        took = time.monotonic() - sent
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        for pid in workers:  # the stopped one is in no group of the launcher's: it stayed, stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert took < 2.5, took
    assert "SIGTERM while blocked outside Python" in (tmp_path / "log.txt").read_text()
