"""Bad input (exit 2 with `file:line: what is wrong`, or counted with --on-error skip), interrupted
runs, and the chat format with its role sidecar."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import zstandard
from megatron.core.datasets import indexed_dataset  # required test dependency: fail, never skip

from helpers import assert_one_line_error, run_in_process, run_tool
from mega_tokenize.chat import ROLE_CODES
from megacore.artifacts.reader import open_artifact
from megacore.artifacts.writer import STAGING_MARK
from megacore.data.indexed import IndexedReader
from tokenize_testlib import corpus, write_jsonl


def _cli(*args) -> tuple[int, str, str]:
    p = run_in_process("mega-tokenize", *args, "--no-progress")
    return p.returncode, p.stdout, p.stderr


def _good_lines(n: int) -> list[str]:
    return [json.dumps({"text": d}) for d in corpus(n)]


BAD = {
    "invalid JSON": ('{"text": "unterminated', "invalid JSON"),
    "not an object": ('["text", "a list"]', "expected a JSON object, got an array"),
    "missing key": ('{"body": "hello"}', 'missing key "text"'),
    "non-string key": ('{"text": 42}', 'key "text" is a number, expected a string'),
    "null key": ('{"text": null}', 'key "text" is null, expected a string'),
    "empty document": ('{"text": ""}', 'key "text" is an empty document'),
    "whitespace document": ('{"text": "  \\n "}', 'key "text" is an empty document'),
    "lone surrogate": ('{"text": "a\\ud800b"}', "invalid Unicode"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_line_is_exit_2_with_file_and_line(tmp_path: Path, sp_model: Path, case):
    line, msg = BAD[case]
    lines = _good_lines(30)
    lines.insert(17, line)
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{src}:18: {msg}" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model, "--on-error", "skip")
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.counts.skipped_lines == 1 and m.counts.documents == 30 and m.on_error == "skip"
    assert m.counts.skipped_examples[0].startswith(f"{src}:18: {msg}")
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    ds = indexed_dataset.IndexedDataset(str(tmp_path / "out" / "shards/text"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[*sp.encode(d), 2] for d in corpus(30)]


def test_invalid_utf8_is_reported_with_its_line(tmp_path: Path, sp_model: Path):
    src = tmp_path / "c.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 2 and f"{src}:2: invalid UTF-8" in err


def test_two_objects_on_one_line_are_not_two_documents(tmp_path: Path, sp_model: Path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"} {"text": "c"}\n')
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 2 and f"{src}:2: invalid JSON" in err


def test_blank_lines_are_not_documents(tmp_path: Path, sp_model: Path):
    src = tmp_path / "c.jsonl"
    src.write_text('\n{"text": "a"}\n\n   \n{"text": "b"}\n\n')
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 0, err
    assert open_artifact(tmp_path / "out", "tokens").counts.documents == 2


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_truncated_compressed_file(tmp_path: Path, sp_model: Path, kind):
    # Large enough for several zstd blocks / deflate chunks: the part before the cut decodes.
    lines = [json.dumps({"text": f"{i} {d} {i * 7919 % 1000003}"}) for i, d in enumerate(corpus(200) * 30)]
    raw = ("\n".join(lines) + "\n").encode()
    data = zstandard.ZstdCompressor().compress(raw) if kind == "zst" else gzip.compress(raw)
    src = tmp_path / f"c.jsonl.{kind}"
    src.write_bytes(data[: len(data) * 2 // 3])
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 2 and f"{src}:" in err and "truncated" in err, err
    assert not (tmp_path / "out").exists()
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model, "--on-error", "skip")
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.counts.skipped_lines == 1 and 0 < m.counts.documents < 6000
    assert "truncated" in m.counts.skipped_examples[0]


def test_usage_errors(tmp_path: Path, sp_model: Path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    code, _, err = _cli(tmp_path / "missing.jsonl", tmp_path / "o", "-t", sp_model)
    assert code == 2 and "missing.jsonl: no such file" in err
    code, _, err = _cli(str(tmp_path / "*.nothing"), tmp_path / "o", "-t", sp_model)
    assert code == 2 and "matches no file" in err
    code, _, err = _cli(src, tmp_path / "o", "-t", tmp_path / "c.jsonl")
    assert code == 2 and "tokenizer.json" in err
    code, _, err = _cli(src, tmp_path / "o", "-t", sp_model, "--engine", "fastest")
    assert code == 2 and "--engine" in err
    code, _, err = _cli(src, tmp_path / "o", "-t", sp_model, "--on-error", "ignore")
    assert code == 2 and "--on-error" in err
    (tmp_path / "notart").mkdir()
    (tmp_path / "notart" / "keep.txt").write_text("user data")
    code, _, err = _cli(src, tmp_path / "notart", "-t", sp_model)
    assert code == 2 and "not an artifact" in err and (tmp_path / "notart" / "keep.txt").exists()


def test_interrupted_run_leaves_nothing_complete_looking(tmp_path: Path, sp_model: Path):
    # An error late in a long input stops the run after shards were partly written.
    lines = _good_lines(300) * 20
    lines.append("{broken")
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, _, _ = _cli(src, tmp_path / "out", "-t", sp_model)
    assert code == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # A leftover staging dir of a killed run (its mark names a process that is gone) is neither
    # reused nor mistaken for an artifact.
    (tmp_path / "out.partial" / "shards").mkdir(parents=True)
    (tmp_path / "out.partial" / "shards" / "text.bin").write_bytes(b"half")
    gone = subprocess.Popen(["true"])
    gone.wait()
    mark = {"pid": gone.pid, "host": socket.gethostname(), "kind": "tokens"}
    (tmp_path / "out.partial" / STAGING_MARK).write_text(json.dumps(mark))
    good = write_jsonl(tmp_path / "g.jsonl", [{"text": "ok"}])
    code, _, err = _cli(good, tmp_path / "out", "-t", sp_model)
    assert code == 0, err
    assert not (tmp_path / "out.partial").exists()
    code, _, err = _cli(good, tmp_path / "out", "-t", sp_model)
    assert code == 0 and "reused" in err


def test_console_script_help_json_and_error(tmp_path: Path, sp_model: Path):
    h = run_tool("mega-tokenize", "--help")
    assert h.returncode == 0 and "mega-tokenize 'pile/*.jsonl.zst'" in h.stdout
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in corpus(5)])
    p = run_tool("mega-tokenize", src, tmp_path / "out", "-t", sp_model, "--json", check=True)
    summary = json.loads(p.stdout)
    assert summary["documents"] == 5 and summary["reused"] is False and summary["dtype"] == "uint16"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert_one_line_error(
        run_tool("mega-tokenize", bad, tmp_path / "o2", "-t", sp_model), f"{bad}:2: missing key"
    )


# --- chat -----------------------------------------------------------------------------------------

CONVS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi <|im_end|> there <s>"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": "No.\nDone."},
        ]
    },
    {"system": "You answer math.", "question": "What is 2+2?", "answer": "4"},
    {"question": "Only a question", "answer": "and an answer"},
    {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
            {"role": "tool", "content": "{}"},
        ]
    },
]


def _as_messages(c: dict) -> list[tuple[str, str]]:
    if "messages" in c:
        return [(m["role"], m["content"]) for m in c["messages"]]
    out = [("system", c["system"])] if "system" in c else []
    return [*out, ("user", c["question"]), ("assistant", c["answer"])]


def test_chatml_with_role_sidecar(tmp_path: Path, sp_model: Path):
    src = write_jsonl(tmp_path / "chat.jsonl", CONVS)
    code, _, err = _cli(src, tmp_path / "out", "-t", sp_model, "--format", "chat")
    assert code == 2 and "--add-special-tokens '<|im_start|>,<|im_end|>'" in err
    code, _, err = _cli(
        src,
        tmp_path / "out",
        "-t",
        sp_model,
        "--format",
        "chat",
        "--add-special-tokens",
        "<|im_start|>,<|im_end|>",
    )
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.format == "chat" and m.chat_template == "chatml" and m.roles == ROLE_CODES
    assert m.tokenizer.added_special_tokens == {"<|im_start|>": 400, "<|im_end|>": 401}
    assert m.tokenizer.vocab_size == 402 and m.tokenizer.base_vocab_size == 400
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    start, end = 400, 401
    ids_ds = indexed_dataset.IndexedDataset(str(tmp_path / "out" / m.shards[0].prefix))
    roles_ds = indexed_dataset.IndexedDataset(str(tmp_path / "out" / m.shards[0].sidecars["roles"]))
    assert np.array_equal(ids_ds.sequence_lengths, roles_ds.sequence_lengths)
    assert np.array_equal(ids_ds.document_indices, roles_ds.document_indices)
    for i, conv in enumerate(CONVS):
        want_ids, want_roles = [], []
        for role, content in _as_messages(conv):
            code_ = ROLE_CODES[role]
            head, body, nl = sp.encode(f"{role}\n"), sp.encode(content), sp.encode("\n")
            want_ids += [start, *head, *body, end, *nl]
            want_roles += [0] * (1 + len(head)) + [code_] * (len(body) + 1) + [0] * len(nl)
        want_ids.append(sp.eos_id())
        want_roles.append(0)
        assert ids_ds[i].tolist() == want_ids
        assert roles_ds[i].tolist() == want_roles
    # Assistant-only loss sees exactly the assistant contents and their end markers.
    first = ids_ds[0][roles_ds[0] == ROLE_CODES["assistant"]].tolist()
    assert first == [*sp.encode("Hello!"), end, *sp.encode("No.\nDone."), end]


def test_tokenizer_chat_template(tmp_path: Path, hf_dir: Path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = write_jsonl(tmp_path / "chat.jsonl", CONVS[:3])
    code, _, err = _cli(
        src, tmp_path / "out", "-t", hf_dir, "--format", "chat", "--chat-template", "tokenizer"
    )
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    eos = ref.token_to_id("<|endoftext|>")
    ids = IndexedReader(tmp_path / "out" / m.shards[0].prefix)
    roles = IndexedReader(tmp_path / "out" / m.shards[0].sidecars["roles"])
    for i, conv in enumerate(CONVS[:3]):
        msgs = [{"role": r, "content": c} for r, c in _as_messages(conv)]
        rendered = hf.apply_chat_template(msgs, tokenize=False)
        got = ids[i].tolist()
        # The template's text, its special tokens and the contents, in order. The template ends
        # the conversation with EOS itself: no other is appended.
        assert got[-1] == eos and got[-2] != eos
        assert ref.decode(got, skip_special_tokens=False) == rendered
        asst = [c for r, c in _as_messages(conv) if r == "assistant"]
        got_asst = ids[i][roles[i] == ROLE_CODES["assistant"]].tolist()
        assert ref.decode(got_asst, skip_special_tokens=False) == "".join(a + "<|endoftext|>" for a in asst)
    # The content's literal "<s>" stayed text: the only specials are the template's.
    assert ids[0].tolist().count(ref.token_to_id("<|begin|>")) == 1


CHAT_BAD = {
    "unknown role": (
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role: unknown role 'wizard'",
    ),
    "missing content": ({"messages": [{"role": "user"}]}, "messages[0].content: missing or not a string"),
    "empty messages": ({"messages": []}, '"messages" must be a non-empty array'),
    "no known keys": ({"prompt": "x"}, 'no "messages" array and no "question"/"answer" keys'),
    "empty answer": ({"question": "q", "answer": ""}, '"answer": empty'),
}


@pytest.mark.parametrize("case", list(CHAT_BAD))
def test_bad_conversations(tmp_path: Path, sp_model: Path, case):
    rec, msg = CHAT_BAD[case]
    src = write_jsonl(tmp_path / "chat.jsonl", [CONVS[1], rec, CONVS[2]])
    args = ["-t", sp_model, "--format", "chat", "--add-special-tokens", "<|im_start|>,<|im_end|>"]
    code, _, err = _cli(src, tmp_path / "out", *args)
    assert code == 2 and f"{src}:2: {msg}" in err, err
    code, _, err = _cli(src, tmp_path / "out", *args, "--on-error", "skip")
    assert code == 0 and open_artifact(tmp_path / "out", "tokens").counts.skipped_lines == 1
