"""The trainer's parts, in this process (no torchrun): the schedule and the loss scale against
closed forms worked out here, unscaling before clipping, AdamW's weight-decay groups, the stop
flag, the run lock and the fault plan."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mega_train.faults import Faults
from mega_train.lifecycle import LOCK_FILE, RunLock, StopRequest, held_by
from mega_train.optimizer import make_optimizer, unscale_and_clip
from mega_train.schedule import LossScale, Schedule
from megacore.artifacts.run_spec import OptimizerSpec
from megacore.errors import UserError

LR, MIN, W, N = 1e-3, 1e-4, 3, 13


def cosine(p: float) -> float:
    return MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi * p))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_closed_forms(kind: str) -> None:
    s = Schedule(OptimizerSpec(lr=LR, min_lr=MIN, warmup_steps=W, schedule=kind), N)
    for k in range(W):  # warmup: lr/W, 2 lr/W, lr
        assert s.lr(k) == pytest.approx(LR * (k + 1) / W, rel=1e-12)
    for k in range(W, N + 2):
        p = min(1.0, (k - W) / (N - W))
        want = {"cosine": cosine(p), "linear": LR - (LR - MIN) * p, "constant": LR}[kind]
        assert s.lr(k) == pytest.approx(want, rel=1e-12), (kind, k)
    assert s.lr(N) == pytest.approx(LR if kind == "constant" else MIN)


def test_longer_run_on_resume_continues_the_learning_rate() -> None:
    """train_steps 13 -> 29 at step 8: the lr at step 8 is the old one, what is left of the decay
    (progress 0.5 -> 1) spreads over steps 8..29, and a second change composes."""
    opt = OptimizerSpec(lr=LR, min_lr=MIN, warmup_steps=W)
    old = Schedule(opt, N)
    new = old.resized(29, 8)
    p8 = (8 - W) / (N - W)  # 0.5
    assert new.lr(8) == pytest.approx(old.lr(8), rel=1e-12)
    for k in range(8, 31):
        assert new.lr(k) == pytest.approx(cosine(min(1.0, p8 + (1 - p8) * (k - 8) / (29 - 8))), rel=1e-12)
    shorter = new.resized(20, 15)
    assert shorter.lr(15) == pytest.approx(new.lr(15), rel=1e-12) and shorter.lr(20) == pytest.approx(MIN)
    # What a checkpoint records brings the same schedule back.
    back = Schedule.restored(opt, json.loads(json.dumps(shorter.saved(15))), default_total=999)
    assert [back.lr(k) for k in range(30)] == [shorter.lr(k) for k in range(30)]
    # A change during warmup is the plain schedule of the new length.
    assert Schedule(opt, N).resized(40, 1).lr(20) == pytest.approx(Schedule(opt, 40).lr(20), rel=1e-12)


def test_loss_scale_halves_on_overflow_and_grows_after_its_window() -> None:
    s = LossScale(scale=1024.0, window=3)
    # judge(loss finite, norm finite): a finite loss with an infinite norm is an fp16 overflow.
    assert s.judge(True, False) is False and s.scale == 512.0  # overflow: skipped, halved
    assert s.counters == {"skipped": 1, "nan_steps": 0, "scale_good": 0}
    for _ in range(2):
        assert s.judge(True, True) and s.scale == 512.0
    assert s.judge(True, True) and s.scale == 1024.0  # the third good step in a row doubles it
    assert s.judge(False, False) is False and s.scale == 1024.0  # a NaN loss: a NaN step
    assert s.counters == {"skipped": 2, "nan_steps": 1, "scale_good": 0}
    low = LossScale(scale=1.0, window=3)
    low.judge(True, False)
    assert low.scale == 1.0  # never below 1
    plain = LossScale(scale=None, window=3)
    assert plain.factor == 1.0 and plain.judge(False, True) is False
    assert plain.counters["nan_steps"] == 1


def test_gradients_are_unscaled_before_they_are_clipped() -> None:
    """Gradients g scaled by 1024: the reported norm is |g| (not 1024 |g|) and the clipped
    gradients are g * clip / |g| (clipping the scaled ones first would leave g * clip / (1024 |g|))."""
    torch.manual_seed(0)
    g = [torch.randn(4, 3), torch.randn(5)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in g]
    for p, t in zip(params, g, strict=True):
        p.grad = t * 1024.0
    norm_g = math.sqrt(sum(float((t.double() ** 2).sum()) for t in g))
    clip = norm_g / 4
    norm = unscale_and_clip(params, 1024.0, clip)
    assert float(norm) == pytest.approx(norm_g, rel=1e-6)
    for p, t in zip(params, g, strict=True):
        torch.testing.assert_close(p.grad, t * (clip / norm_g), rtol=1e-5, atol=0)


def test_weight_decay_skips_norms_and_biases() -> None:
    """One AdamW step with zero gradients moves nothing but the decay: a matrix shrinks by
    (1 - lr * weight_decay), a vector (norm, bias) does not change."""
    matrix = torch.nn.Parameter(torch.full((3, 2), 2.0))
    vector = torch.nn.Parameter(torch.full((3,), 2.0))
    opt = make_optimizer([matrix, vector], OptimizerSpec(lr=0.1, weight_decay=0.5))
    for p in (matrix, vector):
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(matrix.detach(), torch.full((3, 2), 2.0 * (1 - 0.1 * 0.5)))
    torch.testing.assert_close(vector.detach(), torch.full((3,), 2.0))


MIXED = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from mega_train.optimizer import make_optimizer
from megacore.artifacts.run_spec import OptimizerSpec
from megacore.parallel.mesh import init_distributed, shutdown

init_distributed()
mesh = init_device_mesh("cpu", (1,))
params = [torch.nn.Parameter(torch.ones(4)),  # a norm under tp without sequence parallel: plain
          torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()])),  # a q/k norm
          torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Replicate()]))]
for p in params:
    p.grad = torch.ones_like(p)
make_optimizer(params, OptimizerSpec(lr=0.1)).step()
assert all(float(p.detach().full_tensor().max() if hasattr(p, "full_tensor") else p.detach().max()) < 1
           for p in params)
shutdown()
print("ok")
"""


def test_fused_adamw_takes_dtensor_and_plain_parameters_together() -> None:
    """Under tp without sequence parallel the norms are plain tensors and Qwen 3's q/k norms
    DTensors; the fused kernel refuses the two kinds in one group ("got mixed torch.Tensor and
    DTensor"), so `make_optimizer` gives each kind its groups (found by `make demo FAMILY=qwen3`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MIXED], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_stop_request_takes_the_first_signal() -> None:
    stop = StopRequest()
    try:
        assert stop.signum == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGUSR1 and stop.name == "SIGUSR1"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_a_second_ctrl_c_aborts_at_once(tmp_path: Path) -> None:
    code = (
        "import os, signal, time\n"
        "from mega_train.lifecycle import StopRequest\n"
        "s = StopRequest()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(1.5)\n"
        "print('first', s.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
        "print('not reached')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130 and p.stdout == "first SIGINT\n", (p.returncode, p.stdout, p.stderr)
    assert p.stderr == "mega-train: error: interrupted again: stopped without saving\n"


def test_run_lock(tmp_path: Path) -> None:
    """Held: a second taker is refused naming the holder; released: taken again; left by a dead
    process of this host (or one whose pid was handed out again): taken over; left by another
    host: refused, naming it."""
    first = RunLock(tmp_path)
    first.acquire("run.json")
    assert held_by(tmp_path / LOCK_FILE)["pid"] == os.getpid()
    with pytest.raises(UserError, match=rf"in use by mega-train pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire("run.json")
    first.release()
    assert held_by(tmp_path / LOCK_FILE) is None and (tmp_path / LOCK_FILE).read_text() == ""

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "started": "2026-01-01 00:00:00"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    again = RunLock(tmp_path)
    again.acquire("run.json")
    assert again.took_over == record
    again.release()

    (tmp_path / LOCK_FILE).write_text(json.dumps({**record, "host": "elsewhere-node-7"}))
    with pytest.raises(UserError, match=r"locked by mega-train pid \d+ on elsewhere-node-7 .* delete"):
        RunLock(tmp_path).acquire("run.json")

    # Left by a process whose pid a live one has now (a restarted container, a reboot): the live
    # one started at another time, so the lock is taken over; the same start time is its holder.
    with subprocess.Popen(["sleep", "60"]) as live:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{live.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        reused = {**record, "pid": live.pid, "start": f"{boot}/{int(ticks) - 100}"}
        (tmp_path / LOCK_FILE).write_text(json.dumps(reused))
        taker = RunLock(tmp_path)
        taker.acquire("run.json")
        assert taker.took_over == reused
        taker.release()
        (tmp_path / LOCK_FILE).write_text(json.dumps({**reused, "start": f"{boot}/{ticks}"}))
        with pytest.raises(UserError, match=rf"in use by mega-train pid {live.pid} "):
            RunLock(tmp_path).acquire("run.json")
        live.kill()


def test_fault_plan_is_parsed_once() -> None:
    assert Faults.parse(None) is None and Faults.parse("") is None
    faults = Faults.parse("kill@7,nan-loss@3")
    assert faults.at("kill", 7) and faults.at("nan-loss", 3) and not faults.at("kill", 3)
    with pytest.raises(UserError, match="MEGA_TRAIN_INJECT: 'explode@3' is not one of"):
        Faults.parse("explode@3")
    # Scoped to a rank and to a start of the job; the one-rank faults are rank 0's unless scoped.
    spec = "kill@5/r1/s0,fail-save@4/s1,hang@9,slow@2/r1"
    assert Faults.parse(spec, rank=0, start=0).planned == {("hang", 9)}
    assert Faults.parse(spec, rank=1, start=0).planned == {("kill", 5), ("slow", 2)}
    assert Faults.parse(spec, rank=0, start=1).planned == {("fail-save", 4), ("hang", 9)}
    assert Faults.parse(spec, rank=1, start=1).planned == {("slow", 2)}
    with pytest.raises(UserError, match="'kill@5/x1': a scope is /rRANK or /sSTART"):
        Faults.parse("kill@5/x1")


# --- the Trainer's phases, in this process (a process group of one) -------------------------------


def test_trainer_phases_in_process(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """setup, resume (fresh), four steps, save, then a second Trainer resuming from that checkpoint
    and stopping on a stop request: every step's loss, lr and grad norm are the CLI reference's
    (one process, the same manifest), the resumed position is the saved one, and the stop saves
    the step it came at."""
    from mega_train.run_plan import plan_run
    from mega_train.trainer import Trainer
    from megacore.parallel.mesh import shutdown
    from runlib import metrics, write_run

    want = [(r["loss"], r["lr"], r["grad_norm"]) for r in metrics(reference)]
    plan = plan_run(write_run(tmp_path, tokens), 1)
    first = Trainer(plan)
    try:
        first.setup()
        first.resume()
        assert first.position.step == 0 and first.resumed is None
        assert not any(first.step() for _ in range(4))
        got = [(r["loss"], r["lr"], r["grad_norm"]) for r in first.flush()]
        assert got == want[:4]
        first.save()
        assert first.last == plan.checkpoints / "step-00000004"
    finally:
        first.close(ok=True)
        shutdown()

    second = Trainer(plan)
    try:
        second.setup()
        second.resume()
        assert (second.resumed, second.position.step, second.position.optimizer_steps) == (first.last, 4, 4)
        second.stop.signum = signal.SIGUSR1  # what the handler sets
        summary = second.fit()
        assert (summary["step"], summary["complete"], summary["stopped_by"]) == (5, False, "SIGUSR1")
        assert summary["out"] == str(plan.checkpoints / "step-00000005")
        assert second.position.metrics["train_loss"] == want[4][0]
    finally:
        second.close(ok=True)
        shutdown()


def test_fp16_follows_fp32_and_its_loss_scale_grows(tmp_path: Path, tokens: Path) -> None:
    """20 steps in fp16 (compute copies of fp32 master weights, dynamic loss scale) against the same
    20 in fp32: every loss within 2% (fp16 keeps 11 bits of mantissa: its logits and gradients are
    rounded, the master weights are not); the scale doubles after every `loss_scale_window` = 4
    applied steps, as worked out here, and the reported grad norm is the unscaled one (near fp32's,
    not 2^k times it)."""
    from mega_train.run_plan import plan_run
    from mega_train.trainer import Trainer
    from megacore.parallel.mesh import shutdown
    from runlib import write_run

    records = {}
    for precision in ("fp32", "fp16"):
        opt = {
            "lr": 3e-3,
            "warmup_steps": 2,
            "min_lr": 3e-4,
            "initial_loss_scale": 256.0,
            "loss_scale_window": 4,
        }
        run_json = write_run(tmp_path / precision, tokens, precision=precision, train_steps=20, optimizer=opt)
        trainer = Trainer(plan_run(run_json, 1))
        try:
            trainer.setup()
            trainer.resume()
            assert not any(trainer.step() for _ in range(20))
            records[precision] = trainer.flush()
        finally:
            trainer.close(ok=True)
            shutdown()
    for a, b in zip(records["fp16"], records["fp32"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 0.1 * b["grad_norm"], (
            a["step"],
            a["grad_norm"],
            b["grad_norm"],
        )
    assert all(r["skipped"] == 0 for r in records["fp16"])
    # The scale a step reports is the one after it: 256 for steps 1-3, 512 from step 4, ...
    assert [r["loss_scale"] for r in records["fp16"]] == [256.0 * 2 ** (k // 4) for k in range(1, 21)]
