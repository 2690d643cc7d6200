"""Fixtures for mega-train tests: a real tokens artifact (mega-tokenize over real text with the tiny
SentencePiece model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_tool
from tokenize_testlib import corpus, write_jsonl


@pytest.fixture(scope="session")
def tokens(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("train-data")
    src = write_jsonl(root / "corpus.jsonl", [{"text": t} for t in corpus(400)])
    out = root / "tokens"
    run_tool("mega-tokenize", src, out, "--tokenizer", sp_model, check=True)
    return out
