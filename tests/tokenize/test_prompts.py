"""`--format prompts`: a prompt a row (a string encoded as it is, or messages rendered with the
chat template's generation prompt, as transformers' `apply_chat_template(add_generation_prompt=True)`
gives them), no EOS, and the row (the prompt as given, the other keys) kept as typed columns beside
the tokens, one row per document; every bad row one line naming file:line (exit 2), or skipped from tokens and columns."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from helpers import assert_one_line_error, run_in_process
from mega_tokenize.chat import ROLE_CODES
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts.reader import open_artifact
from megacore.data.prompts import PromptColumns
from tokenize_testlib import documents, write_jsonl

MATH = [
    {"prompt": "What is 2+3?", "answer": "5", "level": 1, "tests": ["5", "5.0"]},
    {"prompt": "Compute 7*6.", "answer": "42", "level": 2, "tests": []},
    {"prompt": "émigré: 1+1?", "answer": "2", "level": 1, "tests": ["2"], "source": "made up"},
]
CHATS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "answer": "4",
    },
    {"prompt": [{"role": "user", "content": "Name a prime."}], "answer": "2"},
]


def _tokenize(tmp_path: Path, src: Path, tokenizer: Path, **kw) -> Path:
    out = tmp_path / "out"
    tokenize(Options(inputs=[str(src)], out=out, tokenizer=tokenizer, format="prompts", progress=False, **kw))
    return out


def test_string_prompts_and_their_typed_columns(tmp_path: Path, sp_model: Path):
    """Each prompt's ids are SentencePiece's (BOS with --prepend-bos, no EOS: the model writes on),
    all the user's; the other keys come back typed, in row order, a key a row lacks null."""
    out = _tokenize(tmp_path, write_jsonl(tmp_path / "p.jsonl", MATH), sp_model, prepend_bos=True)
    m = open_artifact(out, "tokens")
    assert m.format == "prompts" and m.counts.documents == 3 and not m.append_eos
    assert m.column_types == {
        "prompt": "string",
        "answer": "string",
        "level": "int64",
        "tests": "list<element: string>",
        "source": "string",
    }
    assert m.shards[0].columns == "shards/prompts.columns.parquet"
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    for row, doc, roles in zip(MATH, documents(out), documents(out, "roles"), strict=True):
        ids = sp.encode(row["prompt"])
        assert doc == [sp.bos_id(), *ids] and roles == [0] + [ROLE_CODES["user"]] * len(ids)
    got = PromptColumns(out, m).rows([2, 0])
    assert got == {
        "prompt": [MATH[2]["prompt"], MATH[0]["prompt"]],
        "answer": ["2", "5"],
        "level": [1, 1],
        "tests": [["2"], ["5", "5.0"]],
        "source": ["made up", None],
    }


def test_chat_prompts_end_with_the_generation_prompt(tmp_path: Path, chatml_dir: Path):
    """Messages are `apply_chat_template(add_generation_prompt=True)`'s ids: what the model writes
    next is the assistant's turn."""
    from transformers import AutoTokenizer

    out = _tokenize(tmp_path, write_jsonl(tmp_path / "p.jsonl", CHATS), chatml_dir, chat_template="tokenizer")
    hf = AutoTokenizer.from_pretrained(str(chatml_dir))
    want = [
        hf.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for r in CHATS
    ]
    assert documents(out) == want
    assert hf.decode(want[1]).endswith("<|im_start|>assistant\n")
    m = open_artifact(out, "tokens")
    assert PromptColumns(out, m).rows(range(2)) == {
        "prompt": [r["prompt"] for r in CHATS],
        "answer": ["4", "2"],
    }


def test_chatml_prompts_on_sentencepiece(tmp_path: Path, sp_model: Path):
    """--chat-template chatml ends with `<|im_start|>assistant\\n` too, and with no EOS after it."""
    out = _tokenize(tmp_path, write_jsonl(tmp_path / "p.jsonl", CHATS[1:]), sp_model,
                    add_special_tokens=["<|im_start|>", "<|im_end|>"])  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    start, end = 400, 401  # the added tokens, after the 400-piece vocab
    head, body, nl, turn = (sp.encode(t) for t in ("user\n", "Name a prime.", "\n", "assistant\n"))
    assert documents(out) == [[start, *head, *body, end, *nl, start, *turn]]


def test_parquet_rows_keep_their_column_types(tmp_path: Path, sp_model: Path):
    src = tmp_path / "p.parquet"
    table = pa.table({"prompt": [r["prompt"] for r in MATH], "answer": [1.5, 2.0, None],
                      "ok": [True, False, True]})  # fmt: skip
    pq.write_table(table, src, row_group_size=2)
    out = _tokenize(tmp_path, src, sp_model)
    m = open_artifact(out, "tokens")
    assert m.column_types == {"prompt": "string", "answer": "double", "ok": "bool"}
    got = PromptColumns(out, m).rows([0, 1, 2])
    assert got == {
        "prompt": table["prompt"].to_pylist(),
        "answer": [1.5, 2.0, None],
        "ok": [True, False, True],
    }
    assert len(documents(out)) == 3


def test_skipped_rows_are_in_neither_tokens_nor_columns(tmp_path: Path, sp_model: Path):
    rows = [MATH[0], {"answer": "no prompt"}, {"prompt": "  ", "answer": "blank"}, MATH[1]]
    out = _tokenize(tmp_path, write_jsonl(tmp_path / "p.jsonl", rows), sp_model, on_error="skip")
    m = open_artifact(out, "tokens")
    assert m.counts.documents == 2 and m.counts.skipped_lines == 2
    assert PromptColumns(out, m).rows([0, 1])["answer"] == ["5", "42"]


@pytest.mark.parametrize(
    ("rows", "args", "message"),
    [
        ([{"answer": "5"}], [], 'p.jsonl:1: missing key "prompt"'),
        ([{"prompt": 5}], [], 'p.jsonl:1: "prompt" is a number, expected a string or an array of messages'),
        (
            [MATH[0], {"prompt": "x", "answer": 5}],
            [],
            'column "answer" holds a number, a string in different rows',
        ),
        (MATH, ["--json-key", "text"], "--json-key: --format prompts reads the keys"),
    ],
    ids=["no-prompt", "not-a-prompt", "mixed-column", "json-key"],
)
def test_bad_prompt_rows(tmp_path: Path, sp_model: Path, rows: list, args: list, message: str):
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    p = run_in_process("mega-tokenize", src, tmp_path / "out", "-t", sp_model, "--format", "prompts",
                       "--no-progress", *args)  # fmt: skip
    assert_one_line_error(p, message)
    assert not (tmp_path / "out" / "manifest.json").exists()
