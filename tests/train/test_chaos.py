"""Chaos: one 200-step run killed at 5 random points (one of them in the middle of a save), each
rerun in a layout drawn at random among one process, tp 2, pp 2, dp 2 and tp 2 x pp 2. The final
weights must be within 1e-4 of an uninterrupted one-process run (fp32: other layouts reduce in
another order), the data position exact (every step once, in order), and no checkpoint lost.

Marked slow (`make test-slow`); `python bench/run.py chaos` runs it too and reports the figures.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from helpers import run_tool
from runlib import checkpoint_tensors, metrics, ok, write_run

STEPS, EVERY, KILLS = 200, 10, 5
LAYOUTS = {
    "1": (1, {}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "dp2": (2, {}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2}),
}
TOLERANCE = 1e-4


def launch(run_json: Path, nproc: int, inject: str | None = None):
    env = {"MEGA_TRAIN_INJECT": inject} if inject else {}
    launcher = ["--nproc-per-node", nproc] if nproc > 1 else []
    return run_tool("mega-train", *launcher, "--manifest", run_json, env=env)


def write(directory: Path, tokens: Path, layout: str) -> Path:
    return write_run(
        directory, tokens, train_steps=STEPS, checkpoint={"every": EVERY}, eval={"every": 0},
        batch={"micro_batch_size": 1}, parallel=LAYOUTS[layout][1],
        optimizer={"lr": 1e-3, "warmup_steps": 10, "min_lr": 1e-4},
    )  # fmt: skip


def chaos(root: Path, tokens: Path, seed: int) -> dict:
    """The whole experiment; returns its figures (what the test asserts and the bench prints)."""
    rng = random.Random(seed)
    reference = write(root / "reference", tokens, "1")
    ok(launch(reference, 1))
    kills = sorted(rng.sample(range(EVERY + 1, STEPS), KILLS))
    in_save = rng.randrange(KILLS)  # this kill hits the next save instead of a step
    run_dir, layouts = root / "chaos", []
    for i, k in enumerate([*kills, None]):
        layout = rng.choice(list(LAYOUTS))
        layouts.append(layout)
        run_json = write(run_dir, tokens, layout)
        inject = (
            None
            if k is None
            else (f"kill-in-save@{EVERY * (k // EVERY + 1)}" if i == in_save else f"kill@{k}")
        )
        proc = launch(run_json, LAYOUTS[layout][0], inject)
        assert (proc.returncode == 0) == (k is None), (seed, i, layout, inject, proc.stderr[-2000:])
    want = checkpoint_tensors(reference.parent / "run" / "checkpoints" / f"step-{STEPS:08d}")
    got = checkpoint_tensors(run_dir / "run" / "checkpoints" / f"step-{STEPS:08d}")
    weights = [n for n in want if not n.startswith("optim.")]
    diff = max(float((got[n] - want[n]).abs().max()) for n in weights)
    checkpoints = sorted(p.name for p in (run_dir / "run" / "checkpoints").iterdir() if p.name != "latest")
    manifest = json.loads(
        (run_dir / "run" / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text()
    )
    return {
        "seed": seed,
        "kills": kills,
        "in_save": kills[in_save],
        "layouts": layouts,
        "max_weight_diff": diff,
        "steps": [r["step"] for r in metrics(run_dir / "run")],
        "consumed_samples": manifest["training"]["consumed_samples"],
        "checkpoints": checkpoints,
    }


@pytest.mark.slow
def test_chaos(tmp_path: Path, tokens: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 30)))
    r = chaos(tmp_path, tokens, seed)
    print("chaos:", json.dumps(r | {"steps": f"{r['steps'][0]}..{r['steps'][-1]} ({len(r['steps'])})"}))
    assert r["max_weight_diff"] <= TOLERANCE, r
    assert r["steps"] == list(range(1, STEPS + 1)), r
    assert r["consumed_samples"] == STEPS * 8
    assert r["checkpoints"] == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)], r
