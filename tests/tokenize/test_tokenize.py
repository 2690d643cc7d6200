"""mega-tokenize end to end: every input format, both tokenizer kinds, engines, determinism, and
megatron-core reading the shards back with exactly the reference tokenizer's ids."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import gigatoken  # noqa: F401  (required, like megatron-core: a broken install fails, never skips)
import numpy as np
import pytest
import sentencepiece as spm
import zstandard
from megatron.core.datasets import indexed_dataset

from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts.reader import open_artifact
from megacore.data.indexed import IndexedReader
from megacore.errors import UserError
from tokenize_testlib import corpus, write_jsonl


def _tok(tmp_path: Path, inputs, tokenizer, out="out", **kw):
    opts = Options(
        inputs=[str(i) for i in inputs], out=tmp_path / out, tokenizer=tokenizer, progress=False, **kw
    )
    return tokenize(opts)


def _sp_expected(model: Path, docs: list[str], eos=True, bos=False) -> list[list[int]]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [([sp.bos_id()] if bos else []) + sp.encode(d) + ([sp.eos_id()] if eos else []) for d in docs]


def _megatron_docs(out: Path, prefix: str = "shards/text") -> list[list[int]]:
    ds = indexed_dataset.IndexedDataset(str(out / prefix))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("compress", [None, "zst", "gz"])
def test_formats_read_back_by_megatron_core(tmp_path: Path, sp_model: Path, compress):
    docs = corpus(200)
    name = {None: "c.jsonl", "zst": "c.jsonl.zst", "gz": "c.jsonl.gz"}[compress]
    src = write_jsonl(tmp_path / name, [{"text": d, "id": i} for i, d in enumerate(docs)], compress)
    res = _tok(tmp_path, [src], sp_model)
    m = open_artifact(tmp_path / "out", "tokens")  # checksums verified
    assert m.dtype == "uint16" and m.counts.documents == 200 and m.counts.skipped_lines == 0
    expected = _sp_expected(sp_model, docs)
    assert _megatron_docs(tmp_path / "out") == expected
    assert m.counts.tokens == sum(map(len, expected))
    assert res.manifest.tokenizer.type == "sentencepiece"
    # The tokenizer file is inside the artifact, with its fingerprint.
    copied = tmp_path / "out" / m.tokenizer.files[0]
    assert copied.read_bytes() == sp_model.read_bytes()
    assert len(m.tokenizer.fingerprint) == 64


def test_multi_frame_zst_globs_dirs_and_order(tmp_path: Path, sp_model: Path):
    docs = corpus(90)
    d = tmp_path / "data"
    d.mkdir()
    # Two zstd frames in one file, as pzstd writes them.
    part = [json.dumps({"text": t}) + "\n" for t in docs[:30]]
    c = zstandard.ZstdCompressor()
    (d / "a.jsonl.zst").write_bytes(
        c.compress("".join(part[:10]).encode()) + c.compress("".join(part[10:]).encode())
    )
    write_jsonl(d / "b.jsonl.gz", [{"text": t} for t in docs[30:60]], "gz")
    (d / "sub").mkdir()
    write_jsonl(d / "sub" / "c.jsonl", [{"text": t} for t in docs[60:]])
    (d / "notes.txt").write_text("not an input")
    expected = _sp_expected(sp_model, docs)
    _tok(tmp_path, [d], sp_model, out="dir")
    assert _megatron_docs(tmp_path / "dir") == expected
    _tok(tmp_path, [str(d / "*.jsonl*"), str(d / "sub" / "*.jsonl")], sp_model, out="glob")
    assert _megatron_docs(tmp_path / "glob") == expected


def test_several_json_keys_one_output_each(tmp_path: Path, sp_model: Path):
    docs = corpus(50)
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d, "title": d[:20] + "!"} for d in docs])
    m = _tok(tmp_path, [src], sp_model, json_keys=["text", "title"]).manifest
    assert [s.json_key for s in m.shards] == ["text", "title"]
    assert _megatron_docs(tmp_path / "out", "shards/text") == _sp_expected(sp_model, docs)
    assert _megatron_docs(tmp_path / "out", "shards/title") == _sp_expected(
        sp_model, [d[:20] + "!" for d in docs]
    )


def test_bos_eos_are_explicit(tmp_path: Path, sp_model: Path):
    docs = corpus(20)
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    m = _tok(tmp_path, [src], sp_model, out="a", append_eos=False, prepend_bos=True).manifest
    assert (m.append_eos, m.prepend_bos) == (False, True)
    assert _megatron_docs(tmp_path / "a") == _sp_expected(sp_model, docs, eos=False, bos=True)
    _tok(tmp_path, [src], sp_model, out="b", append_eos=False)
    assert _megatron_docs(tmp_path / "b") == _sp_expected(sp_model, docs, eos=False)


@pytest.mark.parametrize("engine", ["sentencepiece", "hf", "gigatoken"])
def test_every_engine_gives_sentencepiece_ids_and_literal_tags_stay_text(
    tmp_path: Path, sp_model: Path, engine
):
    docs = [*corpus(60), "<s>", "a</s>b", "<unk> <s></s>", "x <s>\n</s> y"]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    m = _tok(tmp_path, [src], sp_model, engine=engine).manifest
    assert m.engine == engine
    got = _megatron_docs(tmp_path / "out")
    assert got == _sp_expected(sp_model, docs)
    # Only the appended EOS is a control token; the typed "<s>"/"</s>" stayed text.
    assert all(1 not in d and 2 not in d[:-1] for d in got)


def test_auto_picks_fast_engine_and_falls_back_loudly(tmp_path: Path, sp_model: Path, sp_unigram: Path):
    docs = corpus(40)
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    assert _tok(tmp_path, [src], sp_model, out="a").manifest.engine == "gigatoken"
    logs: list[str] = []
    opts = Options(inputs=[str(src)], out=tmp_path / "b", tokenizer=sp_unigram, progress=False)
    m = tokenize(opts, log=logs.append).manifest
    assert m.engine == "sentencepiece"
    assert any("gigatoken not used" in line for line in logs), logs
    assert _megatron_docs(tmp_path / "b") == _sp_expected(sp_unigram, docs)


def test_explicit_engine_that_cannot_match_is_an_error(tmp_path: Path, sp_unigram: Path):
    from megacore.errors import UserError

    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    with pytest.raises((UserError, RuntimeError)):
        _tok(tmp_path, [src], sp_unigram, engine="gigatoken")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_same_bytes_for_any_worker_count_and_batch_size(tmp_path: Path, sp_model: Path):
    docs = corpus(400)
    src = write_jsonl(tmp_path / "c.jsonl.zst", [{"text": d} for d in docs], "zst")
    digests = []
    for i, (workers, batch) in enumerate([(1, 8 << 20), (2, 4096), (3, 1000)]):
        m = _tok(tmp_path, [src], sp_model, out=f"o{i}", workers=workers, batch_bytes=batch).manifest
        digests.append({f.path: f.sha256 for f in m.files})
        for f in m.files:  # the manifest's checksums are those of the bytes on disk
            assert hashlib.sha256((tmp_path / f"o{i}" / f.path).read_bytes()).hexdigest() == f.sha256
    assert digests[0] == digests[1] == digests[2]


def test_hf_tokenizer_dir_and_json(tmp_path: Path, hf_dir: Path):
    from tokenizers import Tokenizer

    docs = [*corpus(50), "text with <|endoftext|> and <|im_start|> typed in it"]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    eos = ref.token_to_id("<|endoftext|>")
    specials = {ref.token_to_id(t) for t in ("<|endoftext|>", "<|begin|>", "<|im_start|>", "<|im_end|>")}
    for out, tok in (("dir", hf_dir), ("json", hf_dir / "tokenizer.json")):
        m = _tok(tmp_path, [src], tok, out=out).manifest
        assert m.tokenizer.type == "hf" and m.tokenizer.eos_id == eos
        got = _megatron_docs(tmp_path / out)
        for d, ids in zip(docs, got, strict=True):
            assert ids[-1] == eos and not specials & set(ids[:-1])
            assert ref.decode(ids[:-1], skip_special_tokens=False) == d
    assert "tokenizer/tokenizer_config.json" in open_artifact(tmp_path / "dir", "tokens").tokenizer.files


def test_stop_ids_come_from_generation_config(tmp_path: Path, hf_dir: Path):
    """A tokenizer directory's generation_config.json names the ids that end generation (one or
    several); anything else there is a one-line error naming the file."""
    from mega_tokenize.tokenizer import load_tokenizer

    d = Path(shutil.copytree(hf_dir, tmp_path / "tok"))
    assert load_tokenizer(d).stop_ids == []
    for given, want in ((3, [3]), ([0, 3, 3, 2], [0, 3, 2])):
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": given}))
        assert load_tokenizer(d).stop_ids == want
    for bad in ('{"eos_token_id": "</s>"}', '{"eos_token_id": [1, -2]}', "[1, 2]", "{"):
        (d / "generation_config.json").write_text(bad)
        with pytest.raises(UserError, match="generation_config.json"):
            load_tokenizer(d)


def test_int32_when_vocab_does_not_fit_uint16(tmp_path: Path, sp_model: Path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in corpus(10)])
    many = [f"<extra_{i}>" for i in range(65536)]
    m = _tok(tmp_path, [src], sp_model, add_special_tokens=many).manifest
    assert m.dtype == "int32" and m.tokenizer.vocab_size == 400 + 65536
    assert m.tokenizer.added_special_tokens["<extra_0>"] == 400
    assert IndexedReader(tmp_path / "out" / "shards/text").dtype == np.int32
    assert _megatron_docs(tmp_path / "out") == _sp_expected(sp_model, corpus(10))


def test_rerun_reuses_force_rebuilds_changed_input_is_refused(tmp_path: Path, sp_model: Path):
    from megacore.errors import UserError

    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in corpus(10)])
    first = _tok(tmp_path, [src], sp_model)
    again = _tok(tmp_path, [src], sp_model)
    assert again.reused and again.manifest.created_at == first.manifest.created_at
    with pytest.raises(UserError, match="--force"):
        _tok(tmp_path, [src], sp_model, append_eos=False)
    write_jsonl(src, [{"text": d} for d in corpus(11)])
    with pytest.raises(UserError, match="--force"):
        _tok(tmp_path, [src], sp_model)
    rebuilt = _tok(tmp_path, [src], sp_model, force=True)
    assert not rebuilt.reused and rebuilt.manifest.counts.documents == 11


def test_gzip_module_round_trip_is_what_we_read(tmp_path: Path, sp_model: Path):
    # A .gz written by the gzip command line tool's format (multi-member) also reads.
    docs = corpus(20)
    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress(raw[:100]) + gzip.compress(raw[100:]))
    _tok(tmp_path, [tmp_path / "m.jsonl.gz"], sp_model)
    assert _megatron_docs(tmp_path / "out") == _sp_expected(sp_model, docs)


def test_real_mistral_tokenizer_every_engine_matches_sentencepiece(tmp_path: Path):
    from helpers import mistral_tokenizer

    model = mistral_tokenizer()
    docs = [*corpus(150), "<s>[INST] typed tags [/INST]</s>", "  x\n\n\t  y  ", "😀 漢字 émigré"]
    src = write_jsonl(tmp_path / "c.jsonl.zst", [{"text": d} for d in docs], "zst")
    expected = _sp_expected(model, docs)
    for engine in ("auto", "hf", "sentencepiece"):
        m = _tok(tmp_path, [src], model, out=engine, engine=engine, workers=2).manifest
        assert m.tokenizer.vocab_size == 32000 and m.dtype == "uint16"
        assert _megatron_docs(tmp_path / engine) == expected, engine
    assert open_artifact(tmp_path / "auto", "tokens").engine == "gigatoken"


def test_auto_starts_over_with_the_reference_when_the_fast_engine_differs(
    tmp_path: Path, hf_single_word: Path
):
    from tokenizers import Tokenizer

    from megacore.errors import UserError

    docs = [*corpus(30), "words word sword", *corpus(5)]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    logs: list[str] = []
    opts = Options(inputs=[str(src)], out=tmp_path / "out", tokenizer=hf_single_word, progress=False)
    m = tokenize(opts, log=logs.append).manifest
    assert m.engine == "hf"
    assert any("WARNING" in line and "gigatoken" in line for line in logs), logs
    ref = Tokenizer.from_file(str(hf_single_word))
    eos = ref.token_to_id("<|endoftext|>")
    assert _megatron_docs(tmp_path / "out") == [[*ref.encode(d).ids, eos] for d in docs]
    with pytest.raises(UserError, match="gives different ids"):
        _tok(tmp_path, [src], hf_single_word, out="named", engine="gigatoken")
    assert not (tmp_path / "named").exists() and not (tmp_path / "named.partial").exists()


@pytest.mark.parametrize("compress", ["", "gz"])
def test_batches_ramp_up_and_shrink_same_bytes(tmp_path: Path, sp_model: Path, monkeypatch, compress):
    """The default batch sizing (grow from small, shrink toward the end; compressed: from the
    estimated compression ratio) covers every line once, in order, with the same shards."""
    from mega_tokenize import inputs, parsing

    docs = corpus(400)
    src = write_jsonl(
        tmp_path / f"c.jsonl{'.' + compress if compress else ''}", [{"text": d} for d in docs], compress
    )
    ref = _tok(tmp_path, [src], sp_model, out="ref", workers=1).manifest
    # Scaled down so a small file makes many batches: reads of 512 B, batches of 4-32 KB.
    monkeypatch.setattr(inputs, "_READ", 512)
    monkeypatch.setattr(parsing, "MIN_BATCH", 4096)
    sizes = parsing.batch_sizes([src], 32 << 10, 2)[0]
    batches = list(inputs.read_lines(src, sizes))
    mb = [b.nbytes for b in batches]
    assert max(mb) > 2 * mb[0] and mb[-2] < max(mb), mb  # ramps up, then shrinks
    assert [b.first_line for b in batches] == list(np.cumsum([1] + [b.nlines for b in batches[:-1]]))
    m = _tok(tmp_path, [src], sp_model, out="small", workers=2, batch_bytes=32 << 10).manifest
    assert {f.path: f.sha256 for f in m.files} == {f.path: f.sha256 for f in ref.files}


def test_auto_detects_a_difference_in_a_late_batch(tmp_path: Path, hf_single_word: Path, monkeypatch):
    """Every batch is checked, not only the first: the only documents on which gigatoken differs
    ("words word sword", a single_word added token it does not honour) come in the last batch of
    many, after hundreds of documents on which the engines agree."""
    from tokenizers import Tokenizer

    from mega_tokenize import inputs, parsing
    from megacore.errors import UserError

    monkeypatch.setattr(inputs, "_READ", 512)  # reads of 512 B, so a small file makes many batches
    batch_bytes = 4096
    clean = [d for d in corpus(400) if "word" not in d]
    tricky = "words word sword"
    docs = [*clean[:300], *[f"{tricky} {i}" for i in range(3)], *clean[300:305]]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    # The batches the run makes (its own batching): many, and the tricky documents only in a late one.
    batches = list(inputs.read_lines(src, parsing.batch_sizes([src], batch_bytes, 2)[0]))
    late = [i for i, b in enumerate(batches) if tricky.encode() in bytes(b.data)]
    assert len(batches) >= 10 and late and min(late) >= len(batches) - 3, (len(batches), late)

    # The engines agree on everything else: without the tricky documents auto keeps gigatoken.
    clean_src = write_jsonl(tmp_path / "clean.jsonl", [{"text": d} for d in docs if tricky not in d])
    kept = _tok(tmp_path, [clean_src], hf_single_word, out="clean", batch_bytes=batch_bytes).manifest
    assert kept.engine == "gigatoken"

    logs: list[str] = []
    opts = Options(inputs=[str(src)], out=tmp_path / "out", tokenizer=hf_single_word, progress=False)
    opts.batch_bytes = batch_bytes
    m = tokenize(opts, log=logs.append).manifest
    assert m.engine == "hf"
    assert any("WARNING" in line and "gigatoken" in line and "starting over" in line for line in logs), logs
    ref = Tokenizer.from_file(str(hf_single_word))
    eos = ref.token_to_id("<|endoftext|>")
    assert _megatron_docs(tmp_path / "out") == [[*ref.encode(d).ids, eos] for d in docs]

    with pytest.raises(UserError, match="gives different ids"):
        _tok(tmp_path, [src], hf_single_word, out="named", engine="gigatoken", batch_bytes=batch_bytes)
    assert not (tmp_path / "named").exists() and not (tmp_path / "named.partial").exists()
