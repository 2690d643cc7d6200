"""A run refuses data whose tokenizer maps an id differently from its init checkpoint's tokenizer
(issue #20): compared as vocabularies, so a `.model` and a tokenizer.json of it are one tokenizer.

The checkpoints: a tiny transformers Llama with a tokenizer transformers itself converted from the
`.model` (tokenizer.json only), through mega-convert (`tokenizer_files`); and one that records the
`.model` as a training job does (`tokenizer`). The other tokenizer: a SentencePiece BPE of the same
size, trained on other text. What the ids should be is asked of sentencepiece and `tokenizers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, dry_run_without_torch, run_tool, write_checkpoint
from hf_cases import build
from megacore.artifacts import open_artifact
from megacore.artifacts.manifest import TrainedTokenizer
from megacore.config import ModelConfig
from megacore.models.hf_tokenizer import sentencepiece_tokenizer_json
from megacore.parts import model_tensors
from megacore.tokenizer_files import first_difference, vocabulary
from runlib import TINY_LLAMA, write_run
from tokenize_testlib import corpus, train_bpe, training_text, write_jsonl


def _sp_ids(model: Path) -> dict[int, str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    return {i: sp.id_to_piece(i) for i in range(sp.vocab_size())}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, sp_model: Path) -> Path:
    """A SentencePiece BPE trained like `sp_model`, with its size, on the same text in capitals."""
    data = train_bpe([line.upper() for line in training_text()], len(_sp_ids(sp_model)))
    path = tmp_path_factory.mktemp("other-sp") / "other.model"
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def other_tokens(tmp_path_factory, other_model: Path) -> Path:
    root = tmp_path_factory.mktemp("other-data")
    src = write_jsonl(root / "corpus.jsonl", [{"text": t} for t in corpus(50)])
    run_tool("mega-tokenize", src, root / "tokens", "--tokenizer", other_model, check=True)
    return root / "tokens"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, sp_model: Path) -> Path:
    """mega-convert of a Llama directory whose tokenizer transformers converted from `sp_model`
    and saved as tokenizer.json (no .model beside it)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("converted")
    src = root / "sp"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    hf = build("llama", root / "hf", vocab_size=TINY_LLAMA["vocab_size"])
    AutoTokenizer.from_pretrained(src).save_pretrained(hf)
    assert (hf / "tokenizer.json").is_file() and not (hf / "tokenizer.model").exists()
    run_tool("mega-convert", "hf", hf, root / "ckpt", check=True)
    assert "tokenizer/tokenizer.json" in open_artifact(root / "ckpt", "checkpoint").tokenizer_files
    return root / "ckpt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokens: Path) -> Path:
    """A checkpoint recording the data's tokenizer (`sp_model`) the way a training job does."""
    info = open_artifact(tokens, "tokens").tokenizer
    config = ModelConfig(**TINY_LLAMA)
    out = tmp_path_factory.mktemp("trained") / "ckpt"
    write_checkpoint(
        out,
        {n: torch.zeros(s) for n, s in model_tensors(config).items()},
        config=config,
        side_files={rel: (tokens / rel).read_bytes() for rel in info.files},
        tokenizer=TrainedTokenizer(info),
    )
    return out


def _run_json(directory: Path, init: Path, tokens: Path) -> Path:
    return write_run(directory, tokens, init=init)


@pytest.mark.parametrize("form", ["converted", "trained"])
def test_data_of_another_tokenizer_of_the_same_size_is_refused(
    form: str, request, sp_model: Path, other_model: Path, other_tokens: Path, tmp_path: Path
):
    init = request.getfixturevalue(form)
    theirs, ours = _sp_ids(sp_model), _sp_ids(other_model)
    assert len(theirs) == len(ours)
    i = min(k for k in theirs if theirs[k] != ours[k])
    p = run_tool("mega-train", "--manifest", _run_json(tmp_path, init, other_tokens), "--dry-run")
    assert_one_line_error(
        p,
        f"$.data.sources[0]: {other_tokens} was tokenized with another tokenizer than the init checkpoint {init}",
        f": id {i} is {theirs[i]!r} there and {ours[i]!r} here",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("form", ["converted", "trained"])
def test_the_same_tokenizer_is_accepted_and_the_plan_needs_no_torch(
    form: str, request, tokens: Path, tmp_path: Path
):
    """`converted`: transformers' tokenizer.json against the data's `.model`; `trained`: the same
    `.model` on both sides."""
    run_json = _run_json(tmp_path, request.getfixturevalue(form), tokens)
    dry_run_without_torch("--manifest", run_json, "--dry-run")


def test_vocabularies_are_read_as_sentencepiece_and_tokenizers_read_them(sp_model: Path, tmp_path: Path):
    """A `.model` and the tokenizer.json megacore writes for it are one tokenizer; each file's
    vocabulary is what its own library says."""
    from tokenizers import Tokenizer

    as_json = tmp_path / "tokenizer.json"
    as_json.write_text(json.dumps(sentencepiece_tokenizer_json(sp_model.read_bytes())))
    from_model, from_json = vocabulary(sp_model), vocabulary(as_json)
    assert from_model == _sp_ids(sp_model)
    hf_vocab = Tokenizer.from_file(str(as_json)).get_vocab(with_added_tokens=True)
    assert from_json == {i: t for t, i in hf_vocab.items()}
    assert first_difference(from_model, from_json) is None


def test_added_tokens_count_and_ids_only_one_side_has_do_not(sp_model: Path):
    base = vocabulary(sp_model)
    top = max(base) + 1
    chatml = vocabulary(sp_model, {"<|im_start|>": top, "<|im_end|>": top + 1})
    assert first_difference(base, chatml) is None  # tokens added past the vocab: new rows
    clash = vocabulary(sp_model, {"<|im_start|>": 5})
    assert first_difference(base, clash) == (5, base[5], "<|im_start|>")
