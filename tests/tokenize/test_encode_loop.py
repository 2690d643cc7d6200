"""The encode loop's parts, in process: batches encoded on a pool and handed back in input order, a
batch's ids (and a conversation's roles) appended to the shards, and the engine's sample check."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import sentencepiece as spm

from mega_tokenize.chat import ROLE_CODES
from mega_tokenize.encoding import Encoder, EngineChecks, EngineDisagrees, in_order
from mega_tokenize.inputs import read_lines
from mega_tokenize.job import Job, Options, prepare
from mega_tokenize.parsing import Parsed
from mega_tokenize.shards import Shards
from mega_tokenize.tokenizer import candidate_engine
from megacore.artifacts import ArtifactWriter
from megacore.data.indexed import IndexedReader
from tokenize_testlib import corpus, write_jsonl


def _job(tmp_path: Path, tokenizer: Path, records: list[dict], **kw) -> Job:
    src = write_jsonl(tmp_path / "in.jsonl", records)
    return prepare(
        Options(inputs=[str(src)], out=tmp_path / "out", tokenizer=tokenizer, progress=False, **kw)
    )


def _staged(tmp_path: Path) -> ArtifactWriter:
    w = ArtifactWriter(tmp_path / "art", "tokens")
    w.stage()
    return w


def _docs(prefix: Path) -> list[list[int]]:
    r = IndexedReader(prefix)
    return [r[i].tolist() for i in range(len(r))]


def test_batches_come_back_in_input_order_with_one_waiting(tmp_path: Path, sp_model: Path):
    docs = corpus(300)
    job = _job(tmp_path, sp_model, [{"text": d} for d in docs], engine="sentencepiece")
    encode = Encoder(job, candidate_engine(job.tok, "sentencepiece"))
    # A large batch first, small ones after: those finish first and must wait for it.
    cuts = [0, 200, 205, 210, 230, 250, 300]
    batches = [Parsed({"text": docs[a:b]}, None, b - a) for a, b in pairwise(cuts)]
    pulled: list[Parsed] = []

    def source():
        for p in batches:
            pulled.append(p)
            yield p

    with ThreadPoolExecutor(2) as pool:
        loop = in_order(source(), encode, pool, ahead=2)
        first = next(loop)
        assert len(pulled) == 3  # two batches encoding and one waiting when the first is handed on
        got = [first, *loop]
    assert [p for p, _ in got] == batches
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    for p, encoded in got:
        flat, lengths = encoded["text"]
        want = [[*sp.encode(d), sp.eos_id()] for d in p.texts["text"]]
        assert lengths.tolist() == [len(ids) for ids in want]
        assert flat.tolist() == [t for ids in want for t in ids]


def test_text_batches_append_per_key_with_their_sums(tmp_path: Path, sp_model: Path):
    docs = corpus(60)
    titles = [f"document {i}: {d.split()[0] if d.split() else 'x'}" for i, d in enumerate(docs)]
    records = [{"text": d, "title": t} for d, t in zip(docs, titles, strict=True)]
    job = _job(tmp_path, sp_model, records, json_keys=["text", "title"], prepend_bos=True)
    encode = Encoder(job, candidate_engine(job.tok, "sentencepiece"))
    w = _staged(tmp_path)
    shards = Shards(w, job.keys, job.dtype, job.bos, job.eos, chat=False)
    batches = [Parsed({"text": docs[a:b], "title": titles[a:b]}, None, 0) for a, b in ((0, 40), (40, 60))]
    counts = [shards.write(p, encode(p)) for p in batches]
    shards.close()

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    want = {
        k: [[sp.bos_id(), *sp.encode(t), sp.eos_id()] for t in ts]
        for k, ts in (("text", docs), ("title", titles))
    }
    assert _docs(w.dir / "shards/text") == want["text"] and _docs(w.dir / "shards/title") == want["title"]
    # Per batch: its documents (the same for every key) and its tokens over all keys.
    assert counts == [
        (b - a, sum(len(ids) for k in want for ids in want[k][a:b])) for a, b in ((0, 40), (40, 60))
    ]
    entries = shards.entries()
    assert [(e.prefix, e.json_key, e.documents, e.sidecars) for e in entries] == [
        ("shards/text", "text", 60, {}),
        ("shards/title", "title", 60, {}),
    ]
    assert [e.tokens for e in entries] == [sum(map(len, want["text"])), sum(map(len, want["title"]))]
    assert shards.documents == 60
    recorded = {e.path: e.sha256 for e in w.file_entries()}
    for name in ("text.bin", "text.idx", "title.bin", "title.idx"):
        assert (
            recorded[f"shards/{name}"] == hashlib.sha256((w.dir / "shards" / name).read_bytes()).hexdigest()
        )


def test_chat_batches_append_ids_and_roles_token_for_token(tmp_path: Path, sp_model: Path):
    texts = corpus(12)
    convs = [
        {"messages": [{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}]}
        for i in range(0, 12, 2)
    ]
    job = _job(
        tmp_path,
        sp_model,
        convs,
        format="chat",
        add_special_tokens=["<|im_start|>", "<|im_end|>"],
        engine="sentencepiece",
    )
    encode = Encoder(job, candidate_engine(job.tok, "sentencepiece"))
    w = _staged(tmp_path)
    shards = Shards(w, job.keys, job.dtype, job.bos, job.eos, chat=True)
    (parsed,) = [job.parse(b) for b in read_lines(job.files[0])]  # the run's own parsing
    halves = [Parsed({}, parsed.chats[:2], 0), Parsed({}, parsed.chats[2:], 0), Parsed({}, [], 0)]
    counts = [shards.write(p, encode(p)) for p in halves]
    shards.close()

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    start, end = job.tok.added["<|im_start|>"], job.tok.added["<|im_end|>"]
    want_ids, want_roles = [], []
    for conv in convs:
        ids, roles = [], []
        for m in conv["messages"]:
            head, body, nl = sp.encode(f"{m['role']}\n"), sp.encode(m["content"]), sp.encode("\n")
            ids += [start, *head, *body, end, *nl]
            roles += [0] * (1 + len(head)) + [ROLE_CODES[m["role"]]] * (len(body) + 1) + [0] * len(nl)
        want_ids.append([*ids, sp.eos_id()])
        want_roles.append([*roles, 0])
    assert _docs(w.dir / "shards/chat") == want_ids
    assert _docs(w.dir / "shards/chat.roles") == want_roles
    assert counts == [(2, sum(map(len, want_ids[:2]))), (4, sum(map(len, want_ids[2:]))), (0, 0)]
    (entry,) = shards.entries()
    assert (entry.json_key, entry.documents, entry.sidecars) == ("chat", 6, {"roles": "shards/chat.roles"})


def test_sample_checks_pass_where_the_engines_agree_and_stop_where_they_differ(
    tmp_path: Path, hf_single_word: Path
):
    clean = [d for d in corpus(60) if "word" not in d]
    job = _job(tmp_path, hf_single_word, [{"text": d} for d in clean])
    engine = candidate_engine(job.tok, "gigatoken")
    agree = [Parsed({"text": clean[:30]}, None, 0), Parsed({"text": clean[30:]}, None, 0)]
    checks = EngineChecks(job.tok, engine)
    try:
        assert list(checks.sampled(agree)) == agree
        checks.passed(wait=True)
    finally:
        checks.shutdown()

    differ = [*agree, Parsed({"text": ["words word sword"]}, None, 0)]
    checks = EngineChecks(job.tok, engine)
    try:
        with pytest.raises(EngineDisagrees, match="gives different ids") as e:
            for _ in checks.sampled(differ):
                pass
            checks.passed(wait=True)
        assert e.value.reference == "hf"
    finally:
        checks.shutdown()
