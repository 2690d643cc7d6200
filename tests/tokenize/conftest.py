"""Fixtures of the tokenize tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_single_word(tmp_path_factory, hf_dir: Path) -> Path:
    """A tokenizer.json with a `single_word` added token, which gigatoken does not honour: the two
    engines give different ids on "words"."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken("word", single_word=True)])
    path = tmp_path_factory.mktemp("hfsw") / "tokenizer.json"
    tok.save(str(path))
    return path
