"""bench/bench_gpu_peers.py end to end on its tiny shapes (`run(quick=True)`, on this CPU): every
configuration gets a row, ours and the compiled plain loop measure something, and the ratios are
the quotients of the figures their rows show. The GPU figures themselves need a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
# 41 s with inductor's cache warm, 108 s cold (the two compiled configurations): make test-slow.
pytestmark = pytest.mark.slow


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, object]:
    """The rows of one quick run, by metric; its tokens and work directories under a tmp path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))  # the bench modules import each other by their file names
        bench = importlib.import_module("bench_gpu_peers")
        mp.setattr(bench, "OUT", tmp_path_factory.mktemp("gpu-peers"))
        if "PYTHONPATH" in os.environ:  # run() makes its entries absolute: restored after
            mp.setenv("PYTHONPATH", os.environ["PYTHONPATH"])
        result = bench.run(quick=True)
    return {r.metric: r for r in result}


def find(rows: dict, *words: str):
    hits = [r for m, r in rows.items() if all(w in m for w in words)]
    assert len(hits) == 1, (words, list(rows))
    return hits[0]


CONFIGS = {  # each configuration's own row, by its metric
    "mega": "tiny Llama: mega-train eager, tokens/s",
    "compiled": 'tiny Llama: mega-train "compile": true, tokens/s',
    "hf": "tiny Llama: HF Trainer, tokens/s",
    "plain": "tiny Llama: plain loop, torch.compile, tokens/s",
    "torchtitan": "tiny Llama: torchtitan, tokens/s",
}


def test_a_row_for_every_configuration_and_ratio(rows) -> None:
    assert set(CONFIGS.values()) <= set(rows), list(rows)
    for ours, peer in [('"compile": true', "HF Trainer"), ('"compile": true', "plain loop"), ("eager", "HF")]:
        find(rows, ours, " vs ", peer)
    assert all(r.benchmark == "gpu_peers" for r in rows.values())
    assert not [r for r in rows.values() if r.passed is False], "a configuration of ours failed"


@pytest.mark.parametrize("kind", ["mega", "compiled", "plain"])
def test_ours_and_the_compiled_loop_measure_speed_and_memory(rows, kind: str) -> None:
    row = rows[CONFIGS[kind]]
    assert number(row.ours) > 0, row
    peak = re.search(r"peak (\d+\.\d+) GB \((RSS|GPU allocated)\)", row.note)
    assert peak and float(peak.group(1)) > 0, row.note
    tflops = re.search(r"([\d.e+-]+) TFLOP/s", row.note)
    assert tflops and float(tflops.group(1)) > 0, row.note
    if not torch.cuda.is_available():
        assert "MFU -" in row.note  # no peak to divide by on a CPU


def test_ratios_are_the_quotients_of_the_rows_figures(rows) -> None:
    ratios = [r for m, r in rows.items() if " vs " in m]
    measured = [r for r in ratios if r.ratio is not None]
    assert measured, "not even the compiled plain loop was compared"
    for r in measured:
        assert r.ratio == pytest.approx(number(r.ours) / number(r.peer), rel=1e-9), r
    # The same figures as the configurations' own rows.
    compiled, plain = rows[CONFIGS["compiled"]], rows[CONFIGS["plain"]]
    vs_plain = find(rows, '"compile": true vs plain loop')
    assert (vs_plain.ours, vs_plain.peer) == (compiled.ours, plain.ours)
    assert vs_plain.target == ">= 1.0x"
    assert find(rows, '"compile": true vs HF Trainer').target == ">= 1.3x"


def test_the_trainer_runs_or_names_what_is_missing(rows) -> None:
    row = rows[CONFIGS["hf"]]
    if importlib.util.find_spec("accelerate") is None:
        assert row.ours == "-" and "accelerate" in row.note and "not installed" in row.note, row
        for vs in (find(rows, "eager vs HF"), find(rows, '"compile": true vs HF')):
            assert vs.ratio is None and "accelerate" in vs.note, vs
    else:
        assert number(row.ours) > 0, row


def test_torchtitan_says_when_it_is_not_installed(rows) -> None:
    row = rows[CONFIGS["torchtitan"]]
    if importlib.util.find_spec("torchtitan") is None:
        assert row.ours == "-" and "not installed" in row.note, row
