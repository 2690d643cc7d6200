"""The exported tokenizer encodes as the training data was encoded.

A SentencePiece `.model` is written as a tokenizer.json (megacore.models.hf_tokenizer) that must
give sentencepiece's ids on real text: the Python standard library's sources (code, prose,
whitespace runs, tabs) and the usual traps, with the Mistral tokenizer too where ../shared has it.
Then the whole chain: mega-tokenize (chat, ChatML markers added past the vocab; a Hugging Face
tokenizer with its own chat template), mega-train, mega-export, and `AutoTokenizer` on the export
directory gives the tokens artifact's ids for every conversation (`apply_chat_template`) and
sentencepiece's for text (text that spells out a special token, "<s>", aside: transformers
matches it as the token), with the markers at their ids and every end-of-turn id in
generation_config.json. The real families' tokenizers (Qwen 2.5 and 3, Llama 3.2, Gemma 3), rebuilt
small, go through the same chain in tests/tokenize/test_family_tokenizers.py.
"""

from __future__ import annotations

import json
import random
import shutil
import sysconfig
from pathlib import Path

import pytest

from helpers import run_tool
from megacore.artifacts import open_artifact
from megacore.models.hf_tokenizer import hf_tokenizer_files, sentencepiece_tokenizer_json
from runlib import TINY_LLAMA, ok, train, write_run
from tokenize_testlib import CHATML, corpus, documents, write_jsonl

MISTRAL = Path(__file__).resolve().parents[3] / "shared" / "assets" / "mistral-v1-tokenizer.model"


def real_text(files: int = 120, cap: int = 8000) -> list[str]:
    """The first `files` modules of the standard library (sorted by path, up to `cap` characters
    each) and the traps of tokenize_testlib's corpus: real documents, not a few words."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.glob("*.py"))[:files]
    return [p.read_text(errors="replace")[:cap] for p in paths] + corpus(200)


@pytest.mark.parametrize("which", ["tiny", "mistral"])
def test_sentencepiece_json_encodes_as_sentencepiece(which: str, sp_model: Path) -> None:
    import sentencepiece as spm
    from tokenizers import Tokenizer

    path = sp_model if which == "tiny" else MISTRAL
    if not path.is_file():
        pytest.skip("../shared/assets has no Mistral tokenizer here")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tok = Tokenizer.from_str(json.dumps(sentencepiece_tokenizer_json(path.read_bytes())))
    tok.encode_special_tokens = True  # as mega-tokenize encodes: a literal "<s>" is text
    texts = real_text()
    differ = [t[:80] for t in texts if tok.encode(t, add_special_tokens=False).ids != sp.encode(t)]
    assert not differ, (len(differ), len(texts), differ[:3])


def test_unigram_models_are_refused(sp_unigram: Path) -> None:
    with pytest.raises(ValueError, match="unigram"):
        sentencepiece_tokenizer_json(sp_unigram.read_bytes())


def test_ids_past_the_embedding_rows_are_refused(sp_model: Path, tmp_path: Path) -> None:
    from megacore.artifacts.manifest import TokenizerInfo, TrainedTokenizer

    info = TokenizerInfo(type="sentencepiece", files=["t.model"], vocab_size=402, fingerprint="x",
                         added_special_tokens={"<|im_start|>": 400, "<|im_end|>": 401})  # fmt: skip
    (tmp_path / "t.model").write_bytes(sp_model.read_bytes())
    with pytest.raises(ValueError, match="ids up to 401 and the model 401 embedding rows"):
        hf_tokenizer_files(tmp_path, TrainedTokenizer(info), vocab_rows=401, max_len=64)


def conversations(n: int) -> list[dict]:
    """Conversations of real text; none spells out a special token (see the module docstring)."""
    rng = random.Random(0)
    texts = [t for t in corpus(100) if "<s>" not in t and "</s>" not in t]
    return [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": rng.choice(texts)[:80]},
                {"role": "assistant", "content": rng.choice(texts)[:60]},
            ]
        }
        for _ in range(n)
    ]


def added_id(tok_dir: Path, token: str) -> int:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    return next(t["id"] for t in data["added_tokens"] if t["content"] == token)


def export_recording(tmp_path: Path, tokens: Path) -> Path:
    """A tiny Llama checkpoint (random weights) that records `tokens`' tokenizer as a run's
    checkpoints do (`RunPlan.tokenizer`, `CheckpointWriter.add_tokenizer`), exported by mega-export:
    the tokenizer an export writes does not depend on the weights, so no training is needed."""
    import torch

    from megacore.artifacts import write_artifact
    from megacore.artifacts.manifest import Layout, TrainedTokenizer
    from megacore.artifacts.pieces import whole
    from megacore.checkpoint import CheckpointWriter, shard_file
    from megacore.config import ModelConfig
    from megacore.parts import model_tensors

    config = ModelConfig(**{**TINY_LLAMA, "vocab_size": 512, "max_seq_len": 128})
    data = open_artifact(tokens, "tokens")
    g = torch.Generator().manual_seed(0)
    weights = {n: 0.02 * torch.randn(s, generator=g) for n, s in model_tensors(config).items()}
    with write_artifact(tmp_path / "ckpt", "checkpoint") as w:
        cw = CheckpointWriter(w)
        cw.write_file(shard_file(0, 0), [(n, t.shape, whole(t.shape), t) for n, t in weights.items()])
        recorded = TrainedTokenizer(data.tokenizer, data.chat_template, data.prepend_bos)
        cw.commit(
            config=config, dtype="float32", layout=Layout(stage_layers=[list(range(config.num_layers))]),
            producer=("tests", "0"), tokenizer=cw.add_tokenizer(tokens, recorded),
        )  # fmt: skip
    out = tmp_path / "hf"
    run_tool("mega-export", tmp_path / "ckpt", out, check=True)
    return out


def export_trained(tmp_path: Path, tokens: Path) -> Path:
    """Two training steps of the tiny Llama on `tokens`, exported with mega-export."""
    run_json = write_run(
        tmp_path, tokens, model={"config": {**TINY_LLAMA, "vocab_size": 512, "max_seq_len": 128}},
        batch={"micro_batch_size": 2, "global_batch_size": 2, "seq_length": 64}, train_steps=2,
        optimizer={"lr": 1e-3, "warmup_steps": 0, "min_lr": 1e-4}, eval={"every": 0}, data={"split": [1, 0]},
    )  # fmt: skip
    ok(train(run_json))
    out = tmp_path / "hf"
    run_tool("mega-export", tmp_path / "run" / "checkpoints" / "latest", out, check=True)
    return out


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_exported_tokenizer_encodes_as_the_training_data(
    tmp_path: Path, sp_model: Path, hf_dir: Path, kind: str
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    convs = conversations(40)
    src = write_jsonl(tmp_path / "chat.jsonl", convs)
    tokens = tmp_path / "tokens"
    if kind == "sentencepiece":  # ChatML, its markers added past the tokenizer's 400 pieces
        args = ["-t", sp_model, *CHATML]
    else:  # the tokenizer's own chat template (its markers are in its vocab), and several stop ids
        # in generation_config.json, as Llama 3.1 has (its <|eot_id|>, <|eom_id|>, <|end_of_text|>)
        hf_dir = Path(shutil.copytree(hf_dir, tmp_path / "tok"))
        named_stops = [added_id(hf_dir, t) for t in ("<|endoftext|>", "<|im_end|>", "<|begin|>")]
        (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": named_stops}))
        args = ["-t", hf_dir, "--chat-template", "tokenizer"]
    run_tool("mega-tokenize", src, tokens, "--format", "chat", *args, check=True)
    manifest = open_artifact(tokens, "tokens")
    out = export_trained(tmp_path, tokens)

    tok = AutoTokenizer.from_pretrained(out)
    info = manifest.tokenizer
    # Every conversation: the artifact's ids are the template's rendering. With ChatML they are the
    # very ids `apply_chat_template` gives, then the EOS mega-tokenize appends (ChatML ends a turn
    # with <|im_end|>, not a stop token of this tokenizer's). This tokenizer's own template ends
    # the conversation with its EOS itself, and nothing is appended after it. It renders the same
    # text, but mega-tokenize encodes each message's content apart from the template's text around
    # it (so a user typing a marker gets text), and this byte-level BPE (no regex split of its
    # own) merges across those edges when it encodes the whole rendering: the decoded text is
    # compared. (The real families' regex splits do not merge there: tests/tokenize/
    # test_family_tokenizers.py compares their ids.)
    docs = documents(tokens)
    assert len(docs) == len(convs)
    for conv, doc in zip(convs, docs, strict=True):
        assert doc[-1] == info.eos_id
        if kind == "sentencepiece":
            assert tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False) == doc[:-1]
        else:
            assert tok.decode(doc) == tok.apply_chat_template(conv["messages"], tokenize=False)
    # Text: the tokenizer's own ids, and nothing added (the data had no BOS).
    if kind == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(sp_model))
        expect = sp.encode
    else:
        from tokenizers import Tokenizer

        ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        expect = lambda t: ref.encode(t, add_special_tokens=False).ids  # noqa: E731
    # transformers matches a special token spelled out in text ("<s>"): chat templates rely on it,
    # and mega-tokenize never does it to raw text. Text that spells one is the one exception.
    specials = [t.content for t in tok.added_tokens_decoder.values()]
    texts = [t for t in real_text(60) if not any(s in t for s in specials)]
    assert len(texts) > 150
    differ = [t[:80] for t in texts if tok(t)["input_ids"] != expect(t)]
    assert not differ, (len(differ), differ[:3])
    # The markers at the artifact's ids; generation stops at EOS and at the end of a turn.
    for name in ("<|im_start|>", "<|im_end|>"):
        want = info.added_special_tokens.get(name)
        if want is not None:
            assert tok.convert_tokens_to_ids(name) == want
    stops = GenerationConfig.from_pretrained(out).eos_token_id
    stops = stops if isinstance(stops, list) else [stops]
    assert info.eos_id in stops
    if kind == "sentencepiece":
        assert info.added_special_tokens["<|im_end|>"] in stops
    else:
        assert info.stop_ids == named_stops and set(named_stops) <= set(stops)
    assert len(tok) <= json.loads((out / "config.json").read_text())["vocab_size"]
