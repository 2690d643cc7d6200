"""A run left alone: what a person, a scheduler or a crash does to it never loses work nor rewinds
silently. Real processes: mega-train alone and as its own launcher (`--nproc-per-node`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, assert_bitwise_equal
from mega_train.launch import children
from runlib import checkpoint_tensors, metrics, ok, train, write_run

LONG = {"train_steps": 100000, "checkpoint": {"every": 100000}}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(*args: object) -> subprocess.Popen:
    cmd = [str(BIN / "mega-train"), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= n):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not start"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # 13 s; make test holds the lock's refusal in process (test_trainer_parts.py)
def test_a_second_launch_on_the_same_out_is_refused(tmp_path: Path, tokens: Path) -> None:
    """While a run trains, a second launch on its `out` (2 workers) exits 2 with one line naming
    the live run and writes nothing; the first then stops on SIGTERM with its work intact."""
    run_json = write_run(tmp_path, tokens, **LONG)
    out = tmp_path / "run"
    first = start("--manifest", run_json)
    wait_for_steps(out, 2, first)
    second = subprocess.run(
        [str(BIN / "mega-train"), "--nproc-per-node", "2", "--manifest", str(run_json)],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert second.returncode == 2, (second.stdout, second.stderr)
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by mega-train pid {first.pid}" in lines[0], second.stderr
    assert "--force" not in second.stderr
    assert not list((out / "checkpoints").iterdir())
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, steps[-1] + 1))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", f"step-{steps[-1]:08d}"]
    assert (out / ".lock").read_text() == ""  # released


def test_damaged_newest_checkpoint_is_set_aside(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """The newest checkpoint truncated (found by size at start) or overwritten in place (found by
    its sha256 as it is read): named on one line, set aside, the run resumes from the one before,
    ends bit-identical to the reference, and a rerun is not blocked."""
    want = checkpoint_tensors(reference / "checkpoints" / "step-00000012")
    for damage in ("truncated", "overwritten"):
        run_json = write_run(tmp_path / damage, tokens)
        out = run_json.parent / "run"
        shutil.copytree(
            reference, out, symlinks=True, ignore=shutil.ignore_patterns("step-00000004", ".lock")
        )
        shard = out / "checkpoints" / "step-00000012" / "model-pp00-tp00.safetensors"
        data = bytearray(shard.read_bytes())
        if damage == "truncated":
            shard.write_bytes(data[:-100])
        else:
            data[len(data) // 2 : len(data) // 2 + 4096] = os.urandom(4096)
            shard.write_bytes(bytes(data))
        dry = ok(train(run_json, "--dry-run", "--verify", "sha256"))
        assert "step-00000012 is damaged" in dry.stdout and "the run will set it aside" in dry.stdout
        assert "resumes from" in dry.stdout and "step-00000008 (step 8 of 12)" in dry.stdout
        summary = json.loads(ok(train(run_json, "--dry-run", "--json", "--verify", "sha256")).stdout)
        assert (summary["resumes_at"], summary["complete"]) == (8, False)
        assert (out / "checkpoints" / "step-00000012").is_dir()  # a dry run moves nothing
        resumed = ok(train(run_json))
        assert (
            "model-pp00-tp00.safetensors" in resumed.stdout
            and "set aside as step-00000012.damaged" in resumed.stdout
        )
        assert "step-00000008 (step 8 of 12)" in resumed.stdout, resumed.stdout
        aside = out / "checkpoints" / "step-00000012.damaged"
        assert aside.is_dir() and (aside / "manifest.json").is_file()
        assert os.readlink(out / "checkpoints" / "latest") == "step-00000012"
        got = checkpoint_tensors(out / "checkpoints" / "step-00000012")
        for name in want:
            assert_bitwise_equal(got[name], want[name], (damage, name))
        again = ok(train(run_json))
        assert "already complete" in again.stdout


def test_stop_signals_to_the_launcher(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """SIGTERM to `mega-train --nproc-per-node 2`, and Ctrl-C's SIGINT to one with a single worker:
    a checkpoint at the signal's step, exit 0, rank 0's one line and no traceback; the SIGINT run's
    rerun ends bit-identical to the uninterrupted reference."""
    want = checkpoint_tensors(reference / "checkpoints" / "step-00000012")
    cases = [
        (signal.SIGTERM, 2, LONG | {"batch": {"micro_batch_size": 4}}),
        (signal.SIGINT, 1, {"checkpoint": {"every": 100}}),
    ]
    for sig, nproc, overrides in cases:
        run_json = write_run(tmp_path / sig.name, tokens, **overrides)
        out = run_json.parent / "run"
        proc = start("--nproc-per-node", nproc, "--manifest", run_json)
        wait_for_steps(out, 3, proc)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, (sig, stdout[-2000:], stderr[-3000:])
        assert "Traceback" not in stderr and "Error" not in stderr, stderr
        saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
        step = int(saved[-1].removeprefix("step-"))
        assert saved == [f"step-{step:08d}"] and metrics(out)[-1]["step"] == step
        assert stdout.count(f"{sig.name} at step {step}: checkpoint saved") == 1, stdout
        if sig == signal.SIGINT:
            ok(train(run_json))
            got = checkpoint_tensors(out / "checkpoints" / "step-00000012")
            for name in want:
                assert_bitwise_equal(got[name], want[name], name)
            assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(reference)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_while_the_workers_start_is_one_line(tmp_path: Path, tokens: Path, sig) -> None:
    """A stop that comes before the first step (the workers still importing and setting up, none
    able to save yet): the launcher ends with the signal's exit code, one line on stderr and nothing
    saved, whichever of it and its workers says it."""
    run_json = write_run(tmp_path, tokens, **LONG)
    proc = start("--nproc-per-node", "2", "--manifest", run_json)
    deadline = time.time() + 60
    while len(children(proc.pid)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, stdout[-2000:], stderr[-3000:])
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


def test_a_killed_worker_is_named_by_the_launcher(tmp_path: Path, tokens: Path) -> None:
    """Rank 0 SIGKILLed after step 2's backward under `mega-train --nproc-per-node 2`: the launcher
    names it ("rank 0 was killed by SIGKILL", not rank 1 whose collective then failed) and exits
    with 128 + SIGKILL."""
    run_json = write_run(tmp_path, tokens, train_steps=4, eval={"every": 0}, checkpoint={"every": 100})
    killed = train(run_json, "--nproc-per-node", "2", env={"MEGA_TRAIN_INJECT": "kill@2/r0"})
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr[-3000:]
    assert "mega-train: error: rank 0 was killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]


def test_workers_stop_when_the_launcher_is_killed(tmp_path: Path, tokens: Path) -> None:
    """SIGKILL to the launcher: within 10 s no worker is alive and nothing more is written."""
    run_json = write_run(tmp_path, tokens, batch={"micro_batch_size": 4}, **LONG)
    out = tmp_path / "run"
    proc = start("--nproc-per-node", "2", "--manifest", run_json)
    wait_for_steps(out, 2, proc)
    ranks = children(proc.pid)
    assert len(ranks) == 2, ranks
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while [pid for pid in ranks if alive(pid)] and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if alive(pid)], "workers outlived their launcher by 10 s"
    size = (out / "metrics.jsonl").stat().st_size
    time.sleep(2)
    assert (out / "metrics.jsonl").stat().st_size == size


def test_a_second_ctrl_c_during_a_save_leaves_nothing(tmp_path: Path, tokens: Path) -> None:
    """Ctrl-C asks for a save; a second one while that checkpoint is being written aborts at once:
    exit 130, one line, and neither the checkpoint nor its staging directory is left."""
    run_json = write_run(tmp_path, tokens, **LONG)
    out = tmp_path / "run"
    cmd = [str(BIN / "mega-train"), "--manifest", str(run_json)]
    # Whichever step the stop lands on, its save waits once its files are written.
    env = {**ENV, "MEGA_TRAIN_INJECT": ",".join(f"stall-in-save@{k}" for k in range(1, 500))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("step-*.partial/model-pp00-tp00.safetensors")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.5)  # a second press, not the same one reaching the process twice
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert stderr == "mega-train: error: interrupted again: stopped without saving\n"
    assert not list((out / "checkpoints").iterdir()), "a checkpoint or its staging was left"


def test_train_steps_change_on_resume(tmp_path: Path, tokens: Path) -> None:
    """Killed at step 7 of 12 (checkpoint at 4), resumed with train_steps 20: said on one line, the
    lr continues from the old schedule's and decays to min_lr at 20 (closed form worked out here);
    another lr is refused naming the field."""
    run_json = write_run(tmp_path, tokens)
    out = tmp_path / "run"
    killed = train(run_json, env={"MEGA_TRAIN_INJECT": "kill@7"})
    assert killed.returncode == -signal.SIGKILL
    write_run(tmp_path, tokens, train_steps=20, eval={"every": 0})
    resumed = ok(train(run_json))
    assert "train_steps 12 -> 20 on resume" in resumed.stdout, resumed.stdout
    lr, low, warmup = 3e-3, 3e-4, 2  # runlib.write_run's optimizer
    p4 = (4 - warmup) / (12 - warmup)
    for r in metrics(out):
        k = r["step"] - 1  # the step's index
        p = (k - warmup) / (12 - warmup) if k < 4 else p4 + (1 - p4) * (k - 4) / (20 - 4)
        want = lr * (k + 1) / warmup if k < warmup else low + (lr - low) * 0.5 * (1 + math.cos(math.pi * p))
        assert math.isclose(r["lr"], want, rel_tol=1e-9), (r["step"], r["lr"], want)
    assert [r["step"] for r in metrics(out)] == list(range(1, 21))
    write_run(tmp_path, tokens, train_steps=30, optimizer={"lr": 1e-3, "warmup_steps": 2, "min_lr": 3e-4})
    refused = train(run_json)
    assert refused.returncode == 2 and "$.optimizer.lr differs" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_sigterm_to_plain_torchrun_saves_then_torchrun_fails(tmp_path: Path, tokens: Path) -> None:
    """Plain torchrun, as the README documents it: SIGTERM to torchrun itself reaches the workers,
    which save at the next step boundary within torchrun's grace period; torchrun then exits 1 (its
    SignalException) and the rerun resumes from that checkpoint."""
    from runlib import free_port

    run_json = write_run(tmp_path, tokens, batch={"micro_batch_size": 4}, **LONG)
    out = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(BIN / "mega-train"), "--manifest", str(run_json)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1 and "SignalException" in stderr, (proc.returncode, stderr[-2000:])
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    step = int(saved[-1].removeprefix("step-"))
    assert saved == [f"step-{step:08d}"] and metrics(out)[-1]["step"] == step
    assert f"SIGTERM at step {step}: checkpoint saved" in stdout
    write_run(tmp_path, tokens, batch={"micro_batch_size": 4}, train_steps=step + 1)
    resumed = ok(train(run_json))
    assert f"(step {step} of {step + 1})" in resumed.stdout
