"""One SentencePiece conversion (issue #21): the ids mega-tokenize writes with its `hf` and
`gigatoken` engines are the ids of the tokenizer.json mega-export writes for the same `.model`
(megacore.models.hf_tokenizer), and sentencepiece's, on the Mistral tokenizer and on BPE models
trained here with each way of treating whitespace. gigatoken reads that file wherever its
normalizers can express the model's; where they cannot, `--engine gigatoken` is an error and `auto`
encodes with sentencepiece. Models no tokenizer.json encodes exactly like are refused by the
converter and encoded by sentencepiece alone."""

from __future__ import annotations

import io
import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sentencepiece as spm

from mega_tokenize.pipeline import Options, tokenize
from mega_tokenize.tokenizer import PROBES, load_tokenizer
from megacore.artifacts.manifest import TokensManifest, TrainedTokenizer
from megacore.artifacts.reader import open_artifact
from megacore.errors import UserError
from megacore.models.hf_tokenizer import hf_tokenizer_files, sentencepiece_tokenizer_json
from tokenize_testlib import corpus, documents, training_text, write_jsonl

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EDGES = [
    "  leading, inner   and trailing spaces   ",
    "\ttabs\tand\nnewlines\n",
    "\n  indented after a newline\n  x  \n",
    "\x85next line\x85 and \x85",
    "nbsp\xa0 and\u3000ideographic\u3000 spaces\u2003",
    "\u2028line and paragraph separators\u2029",
    "ends with a bar \u2581",
    "\u2581 starts with one",
    "bars \u2581 \u2581 inside \u2581\u2581 and at the end \u2581 ",
    "<s> <unk> </s> [INST] lookalikes [/INST] <0x41> <0xE2> <|im_start|>",
    "byte fallback: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 🜁 ᚠᛇᚻ 🇫🇷",
    "fullwidth ＡＢＣ！？ and halfwidth ｶﾀｶﾅ",
    "combining e\u0301 n\u0303, ligature ﬁ, ① ㈱ ½",
    "zero width\u200b joiner\u200d bom\ufeff soft\xadhyphen",
    "\x01\x02 control \x7f chars",
]


def stdlib_sources(n: int = 25, cap: int = 4000) -> list[str]:
    """Real code: indentation, blank lines, trailing spaces."""
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n]
    return [p.read_text(errors="replace")[:cap] for p in paths]


TEXTS = [t for t in [*PROBES, *EDGES, *corpus(120), *stdlib_sources()] if t and not t.isspace()]


def train(model_type: str = "bpe", **spec) -> bytes:
    """A SentencePiece model trained on the tests' text (byte fallback; unk 0, bos 1, eos 2)."""
    buf = io.BytesIO()
    options = dict(
        vocab_size=400, model_type=model_type, byte_fallback=True, character_coverage=0.9995,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()), model_writer=buf, **{**options, **spec}
    )
    return buf.getvalue()


# name -> (trainer options, whether gigatoken reads the converted file). The trainer's default
# normalization is nmt_nfkc with extra whitespace removed, as tests/conftest.py's `sp_model`.
MODELS: dict[str, tuple[dict, bool]] = {
    "nmt_nfkc": ({}, True),
    "nfkc": ({"normalization_rule_name": "nfkc"}, True),  # tabs, newlines, U+2581 pass the map
    "identity": ({"normalization_rule_name": "identity"}, False),  # no map: anchored regexes
    "keep_whitespace": ({"remove_extra_whitespaces": False, "normalization_rule_name": "identity"}, True),
    "no_byte_fallback": ({"byte_fallback": False}, False),  # gigatoken: byte fallback only
    "mistral": ({}, True),
}


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory) -> None:
    """Conversions cached under the test session, not the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-converter")
    paths = {}
    for name, (spec, _) in MODELS.items():
        if name != "mistral":
            paths[name] = root / f"{name}.model"
            paths[name].write_bytes(train(**spec))
    return paths


def model_path(models: dict[str, Path], name: str) -> Path:
    if name == "mistral":
        from helpers import mistral_tokenizer

        return mistral_tokenizer()
    return models[name]


def exported(tokens: Path) -> Tokenizer:
    """The tokenizer.json mega-export writes for a checkpoint trained on `tokens`, loaded as
    mega-tokenize encodes (text spelling a special token stays text)."""
    from tokenizers import Tokenizer

    info = open_artifact(tokens, "tokens").tokenizer
    files = hf_tokenizer_files(tokens, TrainedTokenizer(info), vocab_rows=info.vocab_size, max_len=4096)
    tok = Tokenizer.from_str(files["tokenizer.json"])
    tok.encode_special_tokens = True
    return tok


def run(
    tmp_path: Path, model: Path, engine: str, out: str = "tokens", log: Callable[[str], None] | None = None
) -> TokensManifest:
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    opts = Options(inputs=[str(src)], out=tmp_path / out, tokenizer=model, progress=False, engine=engine)
    return tokenize(opts, log=log or (lambda _: None)).manifest


@pytest.mark.parametrize("engine", ["hf", "gigatoken"])
@pytest.mark.parametrize("name", list(MODELS))
def test_written_ids_are_the_exported_tokenizers_and_sentencepieces(
    tmp_path: Path, models: dict[str, Path], name: str, engine: str
) -> None:
    model = model_path(models, name)
    if engine == "gigatoken" and not MODELS[name][1]:
        with pytest.raises((UserError, RuntimeError), match="gigatoken cannot load"):
            run(tmp_path, model, engine)
        assert run(tmp_path, model, "auto", out="auto").engine == "sentencepiece"
        return
    manifest = run(tmp_path, model, engine)
    assert manifest.engine == engine
    written = documents(tmp_path / "tokens")
    export = exported(tmp_path / "tokens")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert len(written) == len(TEXTS)
    assert {doc[-1] for doc in written} == {manifest.tokenizer.eos_id}
    want = [export.encode(t, add_special_tokens=False).ids for t in TEXTS]
    differ = [t[:60] for t, doc, ids in zip(TEXTS, written, want, strict=True) if doc[:-1] != ids]
    assert not differ, (len(differ), differ[:3])
    differ = [t[:60] for t, ids in zip(TEXTS, want, strict=True) if ids != sp.encode(t)]
    assert not differ, (len(differ), differ[:3])


@pytest.mark.parametrize("name", ["nmt_nfkc", "identity", "mistral"])
def test_the_engines_read_megacores_conversion(models: dict[str, Path], name: str) -> None:
    model = model_path(models, name)
    data = json.loads(json.dumps(sentencepiece_tokenizer_json(model.read_bytes())))  # lists, not tuples
    tok = load_tokenizer(model)
    assert json.loads(tok.tokenizer_json(strip_special=False)) == data
    stripped = json.loads(tok.tokenizer_json(strip_special=True))
    assert stripped == {**data, "added_tokens": [t for t in data["added_tokens"] if not t["special"]]}


@pytest.mark.parametrize("kind", ["unigram", "user_defined"])
def test_models_without_an_exact_tokenizer_json_are_encoded_by_sentencepiece(
    tmp_path: Path, kind: str
) -> None:
    spec = {"model_type": "unigram"} if kind == "unigram" else {"user_defined_symbols": ["<tool>", "foo"]}
    model = tmp_path / f"{kind}.model"
    model.write_bytes(train(**spec))
    with pytest.raises(ValueError, match="unigram" if kind == "unigram" else "user-defined"):
        sentencepiece_tokenizer_json(model.read_bytes())
    for engine in ("hf", "gigatoken"):
        with pytest.raises((UserError, RuntimeError), match="cannot be converted"):
            run(tmp_path, model, engine, out=engine)
    logs: list[str] = []
    assert run(tmp_path, model, "auto", out="auto", log=logs.append).engine == "sentencepiece"
    assert any("gigatoken not used" in line for line in logs), logs
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert [doc[:-1] for doc in documents(tmp_path / "auto")] == [sp.encode(t) for t in TEXTS]


def test_where_the_character_map_is_applied_differently_the_engines_are_refused(tmp_path: Path) -> None:
    """tokenizers' and gigatoken's `Precompiled` map the grapheme "\\r\\n" as one character (one
    space where sentencepiece makes two): with whitespace kept, no conversion gives sentencepiece's
    ids, and mega-tokenize's probe texts catch it."""
    model = tmp_path / "crlf.model"
    model.write_bytes(train(remove_extra_whitespaces=False))  # nmt_nfkc maps CR and LF to spaces
    for engine in ("hf", "gigatoken"):
        with pytest.raises(UserError, match=f"engine {engine} gives different ids than sentencepiece"):
            run(tmp_path, model, engine, out=engine)
    logs: list[str] = []
    assert run(tmp_path, model, "auto", out="auto", log=logs.append).engine == "sentencepiece"
    assert any("starting over" in line for line in logs), logs
