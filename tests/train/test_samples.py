"""Samples while training (`eval.samples`, mega_train/sampling.py): the completion of each prompt at
step N equals transformers' greedy `generate` on the export of step N's checkpoint (its tokenizer
encoding the prompt), in one process, at pp 2 and at tp 2 x pp 2 (`make test-slow`); the records
reach metrics.jsonl, the console and a W&B table; a conversation on text data is refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_in_process
from runlib import TINY_LLAMA, greedy_completion, metrics, ok, torchrun, train, wandb_history, write_run

PROMPTS = ["The", "Once upon a time there was"]
NEW = 12
SAMPLES = {"prompts": PROMPTS, "every": 6, "max_new_tokens": NEW}
# Weights drawn wide, so that each position's greedy token differs (12 steps from the default start
# learn the unigram: a run of spaces, which any model would match).
MODEL = {"config": TINY_LLAMA, "init_std": 0.5}


def generate(export: Path, prompt: str) -> str:
    return greedy_completion(export, prompt, NEW)


def check_against_exports(tmp_path: Path, run: Path) -> None:
    """Every sample record equals the greedy completion of the export of its step's checkpoint."""
    rows = metrics(run, "sample")
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (6, 12) for p in PROMPTS]
    for step in (6, 12):
        export = tmp_path / f"hf-{step}"
        ok(run_in_process("mega-export", run / "checkpoints" / f"step-{step:08d}", export))
        for r in (r for r in rows if r["step"] == step):
            assert r["completion"] == generate(export, r["prompt"]), (step, r)
    for step in (6, 12):  # every prompt its own words
        assert len({r["completion"] for r in rows if r["step"] == step}) == len(PROMPTS), rows


def test_samples_equal_transformers_generate_on_the_export(tmp_path: Path, tokens: Path) -> None:
    """One process, W&B offline: each step's samples on the console, in metrics.jsonl and in the
    W&B table `samples` (every sample so far)."""
    logging = {"every": 1, "wandb_project": "mega-test", "wandb_mode": "offline"}
    run_json = write_run(
        tmp_path, tokens, eval={"every": 0, "samples": SAMPLES}, checkpoint={"every": 6}, logging=logging,
        model=MODEL,
    )  # fmt: skip
    proc = ok(train(run_json, env={"WANDB_SILENT": "true"}))
    assert proc.stdout.count(" sample | ") == 2 * len(PROMPTS), proc.stdout
    check_against_exports(tmp_path, tmp_path / "run")
    (history,) = [wandb_history(f)[1] for f in (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")]
    tables = {step: row for step, row in history.items() if row.get("samples/_type") == "table-file"}
    assert sorted(tables) == [6, 12], sorted(tables)
    assert [tables[s]["samples/nrows"] for s in (6, 12)] == [len(PROMPTS), 2 * len(PROMPTS)]


@pytest.mark.dist
@pytest.mark.parametrize(
    ("parallel", "nproc"),
    # `make test-slow`; make test: one process here, and tp's generation in
    # tests/train/test_harness.py's adapter at tp 2
    [
        pytest.param({"pp": 2}, 2, marks=pytest.mark.slow),
        pytest.param({"tp": 2, "pp": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=["pp2", "tp2-pp2"],
)
def test_samples_in_parallel_equal_transformers_generate_on_the_export(
    tmp_path: Path, tokens: Path, parallel: dict, nproc: int
) -> None:
    run_json = write_run(
        tmp_path, tokens, eval={"every": 0, "samples": SAMPLES}, checkpoint={"every": 6},
        parallel=parallel, model=MODEL,
    )  # fmt: skip
    ok(torchrun(nproc, run_json))
    check_against_exports(tmp_path, tmp_path / "run")


def test_a_conversation_on_text_data_exits_2(tmp_path: Path, tokens: Path) -> None:
    chat = {**SAMPLES, "prompts": [[{"role": "user", "content": "hi"}]]}
    run_json = write_run(tmp_path, tokens, eval={"every": 0, "samples": chat})
    assert_one_line_error(train(run_json), "$.eval.samples.prompts[0]: a conversation needs chat data")
    assert json.loads(run_json.read_text())["eval"]["samples"]["prompts"][0][0]["role"] == "user"
