"""The chaos run (tests/train/test_chaos.py) from bench/: one 200-step run killed at 5 random
points (one mid-save), each rerun in a random layout, against an uninterrupted run. Not a speed
benchmark: its row reports what the run must keep — the final weights within 1e-4, every step once,
no checkpoint lost — and fails the table when it does not. `CHAOS_SEED=N` replays a run.

`--quick` skips it (it takes minutes)."""

from __future__ import annotations

import json
import os
import sys

from benchlib import ROOT, launch
from run import Row


def run(quick: bool) -> list[Row]:
    if quick:
        return [Row("chaos", "kills and resumes", "-", "-", None, note="skipped with --quick")]
    p = launch(
        [sys.executable, "-m", "pytest", "-m", "slow", "-q", "-s", "tests/train/test_chaos.py"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("chaos: ")), None)
    if line is None:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        return [Row("chaos", "kills and resumes", "-", "-", None, passed=False, note="no result: see above")]
    r = json.loads(line.removeprefix("chaos: "))
    note = (
        f"seed {r['seed']}; kills at {r['kills']} (mid-save near {r['in_save']}); layouts {' -> '.join(r['layouts'])}; "
        f"steps {r['steps']}; {len(r['checkpoints'])} checkpoints"
    )
    return [
        Row(
            "chaos",
            "final weights vs uninterrupted (max abs diff)",
            f"{r['max_weight_diff']:.2e}",
            "0",
            None,
            target="<= 1e-4, steps exact, no checkpoint lost",
            passed=p.code == 0,
            note=note,
        )
    ]
