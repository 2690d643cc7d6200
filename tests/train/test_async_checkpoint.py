"""Asynchronous checkpoints (mega_train.saving): the same checkpoints as synchronous saves, bit for
bit, each reported in metrics.jsonl; every process SIGKILLed at each moment of a background write
(before its files, after them, after the commit, and from outside while it stalls) leaves nothing a
rerun resumes from unless all its files are intact, and the rerun ends bit-identical to an
uninterrupted run; a failed save keeps nothing and training goes on, until three in a row stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, assert_bitwise_equal, assert_one_line_error, run_tool
from megacore.artifacts import open_artifact
from runlib import checkpoint_tensors, metrics, ok, train, write_run

STEPS, EVERY = 8, 2
COMMON = {"train_steps": STEPS, "eval": {"every": 4, "iters": 1}}
SYNC = {"checkpoint": {"every": EVERY}}
ASYNC = {"checkpoint": {"every": EVERY, "async": True}}
HISTORY = ("step", "loss", "lr", "grad_norm")


def history(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in HISTORY) for r in metrics(out)]


def launch(run_json: Path, inject: str | None = None) -> subprocess.CompletedProcess:
    env = {"MEGA_TRAIN_INJECT": inject} if inject else {}
    return run_tool("mega-train", "--nproc-per-node", "2", "--manifest", run_json, env=env)


def assert_same_checkpoint(got: Path, want: Path, what: object) -> None:
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert a.keys() == b.keys()
    for name in b:
        assert_bitwise_equal(a[name], b[name], (what, name))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tokens: Path) -> Path:
    """8 steps at dp 2, saved synchronously every 2."""
    run_json = write_run(tmp_path_factory.mktemp("sync-dp2"), tokens, **COMMON, **SYNC)
    ok(launch(run_json))
    return run_json.parent / "run"


def test_async_checkpoints_equal_sync_ones_bitwise_and_are_reported(
    tmp_path: Path, tokens: Path, uninterrupted: Path
) -> None:
    run_json = write_run(tmp_path, tokens, **COMMON, **ASYNC)
    ok(launch(run_json))
    out = run_json.parent / "run"
    for step in range(EVERY, STEPS + 1, EVERY):
        name = f"checkpoints/step-{step:08d}"
        assert_same_checkpoint(out / name, uninterrupted / name, step)
    assert history(out) == history(uninterrupted)
    for run in (out, uninterrupted):
        records = metrics(run, "checkpoint")
        assert [r["step"] for r in records] == list(range(EVERY, STEPS + 1, EVERY))
        for r in records:
            files = open_artifact(run / f"checkpoints/step-{r['step']:08d}", "checkpoint").files
            assert r["bytes"] == sum(f.size for f in files) and r["blocked_s"] >= 0 and r["write_s"] > 0
            assert "error" not in r


@pytest.mark.parametrize(
    "moment",
    [
        pytest.param("kill-before-write", marks=pytest.mark.slow),
        "kill-in-save",
        pytest.param("kill-after-commit", marks=pytest.mark.slow),  # 13 s; make test keeps kill-in-save
        pytest.param("outside", marks=pytest.mark.slow),
    ],
)
def test_every_process_killed_during_an_async_write_resumes_only_from_intact_files(
    tmp_path: Path, tokens: Path, uninterrupted: Path, moment: str
) -> None:
    """SIGKILL at step 4's save, on every rank: before its files, after them (before the
    manifest), after the commit (before `latest`), or the launcher's whole process group from
    outside while the write stalls after the files. The rerun resumes from step 4 only if its
    checkpoint is complete and every file's sha256 matches, else from step 2; its last checkpoint
    and every step's record equal the uninterrupted run's."""
    run_json = write_run(tmp_path, tokens, **COMMON, **ASYNC)
    out = run_json.parent / "run"
    if moment == "outside":
        kill_while_stalled(run_json, out / "checkpoints" / "step-00000004.partial")
    else:
        assert launch(run_json, f"{moment}@4").returncode != 0
    committed = (out / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    assert committed == (moment == "kill-after-commit")
    if committed:
        open_artifact(out / "checkpoints" / "step-00000004", "checkpoint", verify="sha256")
    again = ok(launch(run_json))
    assert f"(step {4 if committed else 2} of {STEPS})" in again.stdout, again.stdout
    name = f"checkpoints/step-{STEPS:08d}"
    assert_same_checkpoint(out / name, uninterrupted / name, moment)
    assert history(out) == history(uninterrupted)


def kill_while_stalled(run_json: Path, partial: Path) -> None:
    """Launch with step 4's write stalled after its files; SIGKILL the launcher's process group once
    both ranks' files are there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_TRAIN_INJECT": "stall-in-save@4"}
    cmd = [str(BIN / "mega-train"), "--nproc-per-node", "2", "--manifest", str(run_json)]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(partial.glob("rank-state/*.safetensors"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the save never stalled"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def test_a_failed_save_keeps_nothing_and_training_goes_on(
    tmp_path: Path, tokens: Path, uninterrupted: Path
) -> None:
    """Step 4's save fails on rank 0 (ENOSPC, injected): one warning line, a record with its error,
    no step-4 directory, and the run ends with the uninterrupted run's checkpoints."""
    run_json = write_run(tmp_path, tokens, **COMMON, **ASYNC)
    proc = ok(launch(run_json, "fail-save@4"))
    out = run_json.parent / "run"
    warnings = [line for line in proc.stdout.splitlines() if "saving step 4 failed" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], proc.stdout
    assert "training goes on" in warnings[0]
    (failed,) = [r for r in metrics(out, "checkpoint") if "error" in r]
    assert failed["step"] == 4 and "No space left on device" in failed["error"]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        f"step-{s:08d}" for s in (2, 6, 8)
    ]
    name = f"checkpoints/step-{STEPS:08d}"
    assert_same_checkpoint(out / name, uninterrupted / name, "fail-save")


@pytest.mark.slow  # 6 s; make test keeps a failed save's run going, above
def test_three_failed_saves_in_a_row_stop_the_run(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(tmp_path, tokens, **COMMON, **SYNC)
    proc = train(run_json, env={"MEGA_TRAIN_INJECT": "fail-save@2,fail-save@4,fail-save@6"})
    assert_one_line_error(proc, "saving step 6 failed", "3 saves in a row have failed", "none", code=1)
