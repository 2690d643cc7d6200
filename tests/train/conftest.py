"""Fixtures for mega-train tests: a real tokens artifact (mega-tokenize over real text with the tiny
SentencePiece model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_tool
from runlib import ok, train, write_run
from tokenize_testlib import corpus, write_jsonl


@pytest.fixture(scope="session")
def tokens(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("train-data")
    src = write_jsonl(root / "corpus.jsonl", [{"text": t} for t in corpus(400)])
    out = root / "tokens"
    run_tool("mega-tokenize", src, out, "--tokenizer", sp_model, check=True)
    return out


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tokens: Path) -> Path:
    """12 steps in one process, checkpoints every 4: the run the trainer's tests compare against."""
    run_json = write_run(tmp_path_factory.mktemp("reference"), tokens)
    ok(train(run_json))
    return run_json.parent / "run"
