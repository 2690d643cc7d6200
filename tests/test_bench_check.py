"""`make bench-check` (bench/check.py) without measuring: bench/README.md's guarded table holds a
bf16 figure for every row the guarded benchmarks' `check` gives (fp32 ones where one was
measured), and a measured ratio passes down to 10% below its figure and fails under it. The
measurements themselves are timings: `make bench-check`, never `make test`."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def check():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))  # the bench modules import each other by their file names
        yield importlib.import_module("check")


def row(check, benchmark: str, metric: str, ratio: float | None):
    from run import Row

    return Row(benchmark, metric, "1", "1", ratio, note="measured")


def test_the_readme_records_every_guarded_row(check) -> None:
    figures = check.recorded(check.README.read_text())
    by = {(f.benchmark, f.metric, f.precision): f.ratio for f in figures}
    guarded = {
        "train": ["tokens/s, mega-train vs HF Trainer"],
        "lora": [
            "LoRA step tokens/s, mega-train vs Trainer + PEFT",
            "LoRA peak RSS, mega-train vs Trainer + PEFT",
        ],
        "dpo": ["DPO step pairs/s, mega-train vs TRL DPOTrainer"],
    }
    assert set(guarded) == set(check.GUARDED)
    for benchmark, metrics in guarded.items():
        for metric in metrics:
            assert by.get((benchmark, metric, "bf16"), 0) > 1, (benchmark, metric)
    assert {(b, m) for b, m, precision in by if precision != "bf16"} <= {
        (b, m) for b, metrics in guarded.items() for m in metrics
    }  # fp32 figures where measured (a CPU without bf16 matmuls): of guarded rows only
    assert all(ratio > 1 for ratio in by.values())


def test_a_ratio_more_than_ten_percent_below_its_figure_fails(check) -> None:
    metric = "tokens/s, mega-train vs HF Trainer"
    figures = [check.Figure("train", metric, "fp32", 1.2), check.Figure("train", metric, "bf16", 1.5)]
    measured = [row(check, "train", metric, r) for r in (1.09, 1.07, None)]
    got = check.verdicts(measured, figures, "fp32")
    assert [r.passed for r in got] == [True, False, False]  # 1.2 x 0.9 = 1.08; a failed side fails
    assert got[0].target == ">= 1.08x (1.20x recorded - 10%)"
    (other,) = check.verdicts(measured[:1], figures[1:], "fp32")  # only another precision's figure
    assert other.passed is None and "no fp32 figure" in other.note
