"""Exact resume after SIGKILL in every layout: a run killed at a random step (after backward,
before the update), its rerun killed in the middle of writing the next checkpoint, and the last
rerun must end bit-identical to an uninterrupted run of the same layout — weights, AdamW moments,
and every step's loss, lr, grad norm and loss scale (fp16: the scale and its counters restored).

fp16 (one process) runs with `make test`; the whole matrix with `make test-slow`."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from helpers import assert_bitwise_equal, run_tool
from runlib import checkpoint_tensors, metrics, ok, write_run

STEPS, EVERY = 8, 2
FP16 = {"lr": 3e-3, "warmup_steps": 2, "min_lr": 3e-4, "initial_loss_scale": 2.0**24, "loss_scale_window": 3}
LAYOUTS = {
    "tp2": (2, {"parallel": {"tp": 2}}),
    "pp2-1f1b": (2, {"parallel": {"pp": 2}}),
    "pp2-zbv": (2, {"parallel": {"pp": 2, "schedule": "zbv"}}),
    "dp2": (2, {"batch": {"micro_batch_size": 2}}),
    "tp2xpp2": (4, {"parallel": {"tp": 2, "pp": 2}, "batch": {"micro_batch_size": 1}}),
    "bf16": (1, {"precision": "bf16"}),
    "fp16": (1, {"precision": "fp16", "optimizer": FP16}),
}
FAST = ("fp16",)
HISTORY = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped")


def launch(nproc: int, run_json: Path, inject: str | None = None):
    env = {"MEGA_TRAIN_INJECT": inject} if inject else {}
    if nproc == 1:
        return run_tool("mega-train", "--manifest", run_json, env=env)
    return run_tool("mega-train", "--nproc-per-node", nproc, "--manifest", run_json, env=env)


def history(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in HISTORY) for r in metrics(out)]


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in LAYOUTS]
)
def test_killed_run_resumes_bit_identical(tmp_path: Path, tokens: Path, layout: str) -> None:
    nproc, overrides = LAYOUTS[layout]
    common = {"train_steps": STEPS, "checkpoint": {"every": EVERY}, "eval": {"every": 4, "iters": 1}}
    reference = write_run(tmp_path / "reference", tokens, **common, **overrides)
    ok(launch(nproc, reference))
    seed = random.randrange(1 << 30)
    kill = random.Random(seed).randrange(EVERY + 1, STEPS + 1)  # after the first checkpoint
    run_json = write_run(tmp_path / "killed", tokens, **common, **overrides)
    out = run_json.parent / "run"
    killed = launch(nproc, run_json, f"kill@{kill}")
    assert killed.returncode != 0, (seed, kill, killed.stderr)
    saved = EVERY * ((kill - 1) // EVERY)
    in_save = saved + EVERY  # the next checkpoint the rerun writes
    again = launch(nproc, run_json, f"kill-in-save@{in_save}")
    assert again.returncode != 0 and f"(step {saved} of {STEPS})" in again.stdout, (seed, kill, again.stdout)
    assert (out / "checkpoints" / f"step-{in_save:08d}.partial").is_dir()
    ok(launch(nproc, run_json))
    want = checkpoint_tensors(reference.parent / "run" / "checkpoints" / f"step-{STEPS:08d}")
    got = checkpoint_tensors(out / "checkpoints" / f"step-{STEPS:08d}")
    assert got.keys() == want.keys()
    for name in want:
        assert_bitwise_equal(got[name], want[name], (layout, seed, kill, name))
    assert history(out) == history(reference.parent / "run"), (layout, seed, kill)
    if layout == "fp16":  # the scale moved (overflows, then growth) and was restored across kills
        scales = {r["loss_scale"] for r in metrics(out)}
        assert len(scales) > 1, scales
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.returncode
