"""Fixtures of the tokenize tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenize_testlib import CHATML_TEMPLATE


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


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory, hf_dir: Path) -> Path:
    """The test BPE with ChatML as its own template and `<|im_end|>` as EOS (as Qwen's)."""
    d = tmp_path_factory.mktemp("chatml") / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d
