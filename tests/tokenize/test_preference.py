"""`--format preference`: TRL's preference rows (standard strings, conversations with an explicit or
an implicit prompt) to pairs of adjacent documents, chosen then rejected, with the completion's
tokens marked `completion` in the role sidecar; Parquet rows as jsonl rows; every bad row one line
naming file:line (exit 2), or skipped and counted."""

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
from tokenize_testlib import CHATML_TEMPLATE, documents, write_jsonl

COMPLETION = 5
CHATML = ["<|im_start|>", "<|im_end|>"]

STANDARD = [
    {"prompt": "What is a tokenizer?", "chosen": "It maps text to ids.", "rejected": "A kind of token."},
    {"prompt": "Say <s> literally", "chosen": " <s> as text", "rejected": "No.\nNever."},
    {"prompt": "émigré café 漢字", "chosen": "Unicode 😀", "rejected": "ASCII only"},
]


def _msgs(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


# (prompt, chosen, rejected) as messages; the second has a completion of three messages.
CONVERSATIONS = [
    (
        _msgs(("system", "You are terse."), ("user", "What is 2+2?")),
        _msgs(("assistant", "4")),
        _msgs(("assistant", "Five, I think.")),
    ),
    (
        _msgs(("user", "Count to two.")),
        _msgs(("assistant", "1, 2."), ("user", "And three?"), ("assistant", "3.")),
        _msgs(("assistant", "I cannot count.")),
    ),
]
EXPLICIT = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in CONVERSATIONS]
IMPLICIT = [{"chosen": p + c, "rejected": p + r} for p, c, r in CONVERSATIONS]


def _tokenize(tmp_path: Path, name: str, inputs: list[Path], tokenizer: Path, **kw) -> Path:
    out = tmp_path / name
    opts = Options(inputs=[str(i) for i in inputs], out=out, tokenizer=tokenizer, format="preference",
                   progress=False, batch_bytes=256, **kw)  # fmt: skip
    tokenize(opts)
    return out


def _cli(*args) -> tuple[int, str]:
    p = run_in_process("mega-tokenize", *args, "--no-progress")
    return p.returncode, p.stderr


def _marked(doc: list[int], roles: list[int], code: int) -> list[int]:
    return [t for t, r in zip(doc, roles, strict=True) if r == code]


# --- standard ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [{"prepend_bos": True}, {"append_eos": False}])
def test_standard_pairs_sentencepiece(tmp_path: Path, sp_model: Path, flags: dict):
    """Prompt and completion encoded apart and concatenated (TRL), BOS before the prompt with
    --prepend-bos, EOS after each completion unless --no-append-eos; chosen then rejected."""
    out = _tokenize(tmp_path, "out", [write_jsonl(tmp_path / "p.jsonl", STANDARD)], sp_model, **flags)
    m = open_artifact(out, "tokens")
    assert m.format == "preference" and m.roles == {**ROLE_CODES, "completion": COMPLETION}
    assert m.counts.pairs == 3 and m.counts.documents == 6 and m.shards[0].documents == 6
    assert m.shards[0].sidecars == {"roles": "shards/preference.roles"}
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    bos = [sp.bos_id()] if flags.get("prepend_bos") else []
    eos = [] if flags.get("append_eos") is False else [sp.eos_id()]
    docs, roles = documents(out), documents(out, "roles")
    assert len(docs) == 2 * len(STANDARD)
    for i, (doc, role) in enumerate(zip(docs, roles, strict=True)):
        row, side = STANDARD[i // 2], ("chosen", "rejected")[i % 2]  # document 2k: pair k's chosen
        prompt, completion = sp.encode(row["prompt"]), [*sp.encode(row[side]), *eos]
        assert doc == [*bos, *prompt, *completion], (i, side)
        assert role == [0] * len(bos) + [ROLE_CODES["user"]] * len(prompt) + [COMPLETION] * len(completion)


def test_standard_pairs_hf(tmp_path: Path, hf_dir: Path):
    from tokenizers import Tokenizer

    out = _tokenize(tmp_path, "out", [write_jsonl(tmp_path / "p.jsonl", STANDARD)], hf_dir)
    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ref.encode_special_tokens = True  # raw text: a typed marker stays text
    eos = ref.token_to_id("<|endoftext|>")

    def enc(text: str) -> list[int]:
        return ref.encode(text, add_special_tokens=False).ids

    want = [[*enc(r["prompt"]), *enc(r[side]), eos] for r in STANDARD for side in ("chosen", "rejected")]
    assert documents(out) == want
    assert open_artifact(out, "tokens").counts.pairs == 3


# --- conversations -------------------------------------------------------------------------------


def test_conversations_are_the_templates_ids(tmp_path: Path, chatml_dir: Path):
    """Each side is `apply_chat_template(prompt + completion)`'s ids; the completion's tokens are its
    contents and their end markers, the template's text between them is not."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out = _tokenize(tmp_path, "out", [write_jsonl(tmp_path / "p.jsonl", EXPLICIT)], chatml_dir,
                    chat_template="tokenizer")  # fmt: skip
    m = open_artifact(out, "tokens")
    assert m.chat_template == CHATML_TEMPLATE and m.counts.pairs == 2
    hf = AutoTokenizer.from_pretrained(str(chatml_dir))
    ref = Tokenizer.from_file(str(chatml_dir / "tokenizer.json"))
    docs, roles = documents(out), documents(out, "roles")
    for k, (prompt, *sides) in enumerate(CONVERSATIONS):
        for j, completion in enumerate(sides):
            doc, role = docs[2 * k + j], roles[2 * k + j]
            assert doc == hf.apply_chat_template(prompt + completion, tokenize=True, return_dict=False)
            done = ref.decode(_marked(doc, role, COMPLETION), skip_special_tokens=False)
            assert done == "".join(f"{m['content']}<|im_end|>" for m in completion)
            user = ref.decode(_marked(doc, role, ROLE_CODES["user"]), skip_special_tokens=False)
            assert user == "".join(f"{m['content']}<|im_end|>" for m in prompt if m["role"] == "user")
            template = ref.decode(_marked(doc, role, 0), skip_special_tokens=False)
            assert template == "".join(f"<|im_start|>{m['role']}\n\n" for m in prompt + completion)


def test_chatml_on_sentencepiece(tmp_path: Path, sp_model: Path):
    """--chat-template chatml: the same layout, and the EOS after a conversation that does not end
    with a stop token is the template's (0), as for --format chat."""
    src = write_jsonl(tmp_path / "p.jsonl", EXPLICIT[:1])
    out = _tokenize(tmp_path, "out", [src], sp_model, add_special_tokens=CHATML)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    start, end = 400, 401
    prompt, chosen, rejected = CONVERSATIONS[0]
    for doc, role, completion in zip(
        documents(out), documents(out, "roles"), (chosen, rejected), strict=True
    ):
        want_ids, want_roles = [], []
        for i, msg in enumerate(prompt + completion):
            code = COMPLETION if i >= len(prompt) else ROLE_CODES[msg["role"]]
            head, body, nl = sp.encode(f"{msg['role']}\n"), sp.encode(msg["content"]), sp.encode("\n")
            want_ids += [start, *head, *body, end, *nl]
            want_roles += [0] * (1 + len(head)) + [code] * (len(body) + 1) + [0] * len(nl)
        assert doc == [*want_ids, sp.eos_id()] and role == [*want_roles, 0]


def test_implicit_prompt_gives_the_explicit_artifact(tmp_path: Path, chatml_dir: Path):
    kw = {"chat_template": "tokenizer"}
    explicit = _tokenize(
        tmp_path, "explicit", [write_jsonl(tmp_path / "e.jsonl", EXPLICIT)], chatml_dir, **kw
    )
    implicit = _tokenize(
        tmp_path, "implicit", [write_jsonl(tmp_path / "i.jsonl", IMPLICIT)], chatml_dir, **kw
    )
    _same_shards(explicit, implicit)


def _same_shards(a: Path, b: Path) -> None:
    ma, mb = open_artifact(a, "tokens"), open_artifact(b, "tokens")
    assert ma.counts == mb.counts and ma.shards == mb.shards and ma.roles == mb.roles
    for rel in sorted(p.relative_to(a) for p in (a / "shards").iterdir()):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


# --- Parquet -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ["standard", "explicit", "implicit"])
def test_parquet_rows_equal_jsonl_rows(tmp_path: Path, chatml_dir: Path, rows: str):
    records = {"standard": STANDARD, "explicit": EXPLICIT, "implicit": IMPLICIT}[rows] * 5
    columns = {k: [r[k] for r in records] for k in records[0]}
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({**columns, "id": list(range(len(records)))}), src, row_group_size=4)
    kw = {"chat_template": "tokenizer"}
    jsonl = _tokenize(tmp_path, "jsonl", [write_jsonl(tmp_path / "p.jsonl", records)], chatml_dir, **kw)
    _same_shards(jsonl, _tokenize(tmp_path, "parquet", [src], chatml_dir, **kw))


# --- refusals ------------------------------------------------------------------------------------

_ASK = _msgs(("user", "Hi?"))
BAD = {
    "missing chosen": ({"prompt": "p", "rejected": "r"}, 'missing key "chosen"'),
    "missing rejected": ({"prompt": "p", "chosen": "c"}, 'missing key "rejected"'),
    "standard without prompt": ({"chosen": "c", "rejected": "r"}, 'missing key "prompt"'),
    "empty completion": ({"prompt": "p", "chosen": "c", "rejected": " "}, '"rejected": empty completion'),
    "no completion messages": ({"prompt": _ASK, "chosen": [], "rejected": _msgs(("assistant", "r"))},
                               '"chosen": empty completion'),
    "only empty contents": ({"prompt": _ASK, "chosen": _msgs(("assistant", "")), "rejected": _msgs(("assistant", "r"))},
                            '"chosen": empty completion'),
    "implicit, nothing after the prompt": ({"chosen": _ASK, "rejected": [*_ASK, *_msgs(("assistant", "r"))]},
                                           '"chosen": empty completion'),
    "identical strings": ({"prompt": "p", "chosen": "same", "rejected": "same"},
                          '"chosen" and "rejected" are the same completion'),
    "identical messages": ({"prompt": _ASK, "chosen": _msgs(("assistant", "a")), "rejected": _msgs(("assistant", "a"))},
                           '"chosen" and "rejected" are the same completion'),
    "mixed formats": ({"prompt": "p", "chosen": _msgs(("assistant", "c")), "rejected": "r"},
                      'mixed formats: "prompt" is a string, "chosen" is an array, "rejected" is a string'),
    "prompt does not match": ({"chosen": _msgs(("user", "a"), ("assistant", "b")),
                               "rejected": _msgs(("user", "c"), ("assistant", "d"))},
                              "the prompt does not match"),
    "bad message": ({"prompt": _ASK, "chosen": _msgs(("wizard", "c")), "rejected": _msgs(("assistant", "r"))},
                    "chosen[0].role: unknown role 'wizard'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rows(tmp_path: Path, sp_model: Path, case: str):
    """One line naming file:line, exit 2, nothing written; with --on-error skip the row is counted.
    (sp_model has no ChatML tokens: rows are checked before anything is rendered.)"""
    row, msg = BAD[case]
    src = write_jsonl(tmp_path / "p.jsonl", [STANDARD[0], row, STANDARD[1]])
    code, err = _cli(src, tmp_path / "out", "-t", sp_model, "--format", "preference")
    assert code == 2 and err.count("\n") == 1 and f"{src}:2: {msg}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    code, err = _cli(src, tmp_path / "out", "-t", sp_model, "--format", "preference", "--on-error", "skip")
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.counts.skipped_lines == 1 and m.counts.pairs == 2 and m.counts.documents == 4
    assert m.counts.skipped_examples[0].startswith(f"{src}:2: {msg}")


def test_usage_and_file_refusals(tmp_path: Path, sp_model: Path):
    src = write_jsonl(tmp_path / "p.jsonl", STANDARD)
    pref = ["-t", sp_model, "--format", "preference"]
    p = run_in_process("mega-tokenize", src, tmp_path / "o", *pref, "--json-key", "prompt", "--json-key", "x")
    assert_one_line_error(p, "--json-key: --format preference reads the keys")
    # A conversation needs a template this tokenizer can render: the run stops, skip or not.
    conv = write_jsonl(tmp_path / "c.jsonl", [STANDARD[0], EXPLICIT[0]])
    for on_error in ("fail", "skip"):
        p = run_in_process(
            "mega-tokenize", conv, tmp_path / "o", *pref, "--on-error", on_error, "--no-progress"
        )
        assert_one_line_error(p, f"{sp_model}: ChatML needs the tokens", "--add-special-tokens")
    # Parquet: the columns are checked before anything is read.
    files = {
        "no-rejected": ({"prompt": ["p"], "chosen": ["c"]}, 'no column "rejected"'),
        "no-prompt": ({"chosen": ["c"], "rejected": ["r"]}, 'no column "prompt"'),
        "mixed": ({"prompt": ["p"], "chosen": [_msgs(("assistant", "c"))], "rejected": ["r"]},
                  'columns "prompt" is string, "chosen" is list<'),
    }  # fmt: skip
    for name, (columns, msg) in files.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table(columns), path)
        assert_one_line_error(run_in_process("mega-tokenize", path, tmp_path / "o", *pref), f"{path}: {msg}")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
