"""Online RL's data in a run: prompts (`mega-tokenize --format prompts`) are refused, in one line,
by the objectives that learn the documents they read."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_tool
from runlib import train, write_run
from tokenize_testlib import write_jsonl


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    out = root / "tokens"
    run_tool("mega-tokenize", write_jsonl(root / "p.jsonl", rows), out, "-t", sp_model, "--format", "prompts",
             check=True)  # fmt: skip
    return out


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_prompts_are_refused_by_objectives_that_read_documents(tmp_path: Path, prompts: Path, objective: str):
    spec = {"type": objective} if objective == "lm" else {"type": objective, "teacher": str(tmp_path)}
    run = write_run(tmp_path, prompts, objective=spec)
    assert_one_line_error(train(run, "--dry-run"), "holds prompts (mega-tokenize --format prompts)",
                          f"$.objective.type {objective} does not train on")  # fmt: skip
