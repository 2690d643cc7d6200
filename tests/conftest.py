"""Fixtures every test can use: tokenizers the tests make themselves, a tiny SentencePiece BPE (byte
fallback, like Llama's) and a tiny byte-level `tokenizers` BPE with special tokens and a chat template."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tokenize_testlib import train_bpe, training_text

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[U] {{ m['content'] }} [/U]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% else %}[S] {{ m['content'] }} [/S]{% endif %}{% endfor %}"
)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(train_bpe(training_text(), 400))
    return path


@pytest.fixture(scope="session")
def sp_unigram(tmp_path_factory) -> Path:
    """A unigram model: only sentencepiece itself reads it (no fast engine converts it)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_writer=buf,
        vocab_size=300,
        model_type="unigram",
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spu") / "unigram.model"
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer directory: tokenizer.json + tokenizer_config.json with a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|begin|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    d = tmp_path_factory.mktemp("hf") / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin|>", "eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE})
    )
    return d
