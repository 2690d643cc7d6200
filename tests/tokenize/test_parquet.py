"""Parquet corpora: the same rows as Parquet (several row groups, several files, a Hub-style directory
with nested files, globs) and as jsonl give byte-identical shards and equal manifests but for the
inputs; chat from a messages column; another column chosen with --json-key; bad files are one line
and exit 2 with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import assert_one_line_error, run_tool
from mega_tokenize import inputs
from mega_tokenize.cli import app
from mega_tokenize.inputs import read_parquet
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts.reader import open_artifact
from megacore.cli import run as cli_run
from tokenize_testlib import corpus, write_jsonl

CHATML = ["<|im_start|>", "<|im_end|>"]


def _tok(tmp_path: Path, inputs, tokenizer: Path, out: str, **kw):
    opts = Options(
        inputs=[str(i) for i in inputs],
        out=tmp_path / out,
        tokenizer=tokenizer,
        progress=False,
        batch_bytes=4096,  # many batches: some end inside a row group, some span row groups
        **kw,
    )
    return tokenize(opts).manifest


def _write_parquet(path: Path, columns: dict, row_group_size: int = 40) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def _same_artifact(a: Path, b: Path) -> None:
    """Byte-identical shards and equal manifests apart from the inputs, recipe and time."""
    ma, mb = open_artifact(a, "tokens"), open_artifact(b, "tokens")
    shards = sorted(p.relative_to(a) for p in (a / "shards").iterdir())
    assert shards == sorted(p.relative_to(b) for p in (b / "shards").iterdir())
    for rel in shards:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    da, db = (msgspec.structs.asdict(m) for m in (ma, mb))
    for d in (da, db):
        for k in ("inputs", "recipe_sha256", "created_at"):
            d.pop(k)
    assert da == db


def _cli(capsys, *args) -> tuple[int, str]:
    code = cli_run(app, "mega-tokenize", [*map(str, args), "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("tokenizer", ["sp_model", "hf_dir"])
def test_parquet_files_dirs_and_globs_equal_jsonl(tmp_path: Path, request, tokenizer: str):
    tok = request.getfixturevalue(tokenizer)
    docs = corpus(300)
    write_jsonl(tmp_path / "c.jsonl", [{"id": i, "text": d} for i, d in enumerate(docs)])
    # A dataset as downloaded from the Hub: data/train-0000N-of-00002.parquet, several row groups each.
    hub = tmp_path / "hub"
    files = [
        _write_parquet(
            hub / "data" / f"train-0000{n}-of-00002.parquet",
            {"id": list(range(n * 170, n * 170 + len(part))), "text": part},
        )
        for n, part in enumerate((docs[:170], docs[170:]))
    ]
    (hub / "README.md").write_text("not an input")
    assert all(pq.ParquetFile(f).num_row_groups > 1 for f in files)
    _tok(tmp_path, [tmp_path / "c.jsonl"], tok, "jsonl", workers=2)
    assert open_artifact(tmp_path / "jsonl", "tokens").counts.documents == 300
    for name, srcs in (("dir", [hub]), ("glob", [hub / "data" / "*.parquet"]), ("files", files)):
        _tok(tmp_path, srcs, tok, name, workers=2)
        _same_artifact(tmp_path / "jsonl", tmp_path / name)
    # By content, like compression: a Parquet file under another name is still read as Parquet.
    plain = tmp_path / "one" / "part-0"
    plain.parent.mkdir()
    plain.write_bytes(_write_parquet(tmp_path / "one.parquet", {"text": docs}).read_bytes())
    _tok(tmp_path, [plain], tok, "by-content", workers=2)
    _same_artifact(tmp_path / "jsonl", tmp_path / "by-content")


def test_json_key_selects_columns(tmp_path: Path, sp_model: Path):
    docs, titles = corpus(120), [f"title {i}: {d[:20]}" for i, d in enumerate(corpus(120))]
    write_jsonl(tmp_path / "c.jsonl", [{"body": d, "title": t} for d, t in zip(docs, titles, strict=True)])
    src = _write_parquet(
        tmp_path / "c.parquet", {"text": ["not this"] * 120, "body": docs, "title": titles}, 25
    )
    for keys in (["body"], ["body", "title"]):
        name = "-".join(keys)
        m = _tok(tmp_path, [src], sp_model, name, json_keys=keys)
        assert [s.json_key for s in m.shards] == keys and m.counts.documents == 120
        _tok(tmp_path, [tmp_path / "c.jsonl"], sp_model, name + "-jsonl", json_keys=keys)
        _same_artifact(tmp_path / (name + "-jsonl"), tmp_path / name)


CONVS = [
    [("system", "Be brief."), ("user", "Hi <|im_end|> there <s>"), ("assistant", "Hello!")],
    [("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6\nDone.")],
    [("user", "x"), ("assistant", "y"), ("tool", "{}")],
]


def test_chat_messages_column_equals_jsonl_chat(tmp_path: Path, sp_model: Path):
    convs = [[{"role": r, "content": c} for r, c in conv] for conv in CONVS * 30]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    # Extra struct fields and columns are ignored, as extra keys are in jsonl.
    with_name = [[{**m, "name": None} for m in c] for c in convs]
    src = _write_parquet(tmp_path / "chat.parquet", {"messages": with_name, "id": list(range(90))}, 16)
    kw = {"format": "chat", "add_special_tokens": CHATML}
    _tok(tmp_path, [tmp_path / "chat.jsonl"], sp_model, "jsonl", **kw)
    m = _tok(tmp_path, [src], sp_model, "parquet", **kw)
    assert m.counts.documents == 90 and m.shards[0].sidecars == {"roles": "shards/chat.roles"}
    _same_artifact(tmp_path / "jsonl", tmp_path / "parquet")
    # The messages under another name: --json-key names it, in Parquet and jsonl alike.
    renamed = _write_parquet(tmp_path / "conv.parquet", {"conversation": convs}, 16)
    write_jsonl(tmp_path / "conv.jsonl", [{"conversation": c} for c in convs])
    for name, path in (("renamed", renamed), ("renamed-jsonl", tmp_path / "conv.jsonl")):
        _tok(tmp_path, [path], sp_model, name, json_keys=["conversation"], **kw)
        ma, mb = open_artifact(tmp_path / "jsonl", "tokens"), open_artifact(tmp_path / name, "tokens")
        assert [f.sha256 for f in ma.files if "shards/" in f.path] == [
            f.sha256 for f in mb.files if "shards/" in f.path
        ]


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, list[str], str]]:
    """case -> (input, extra arguments, what the one line says after the file name)."""
    good = _write_parquet(tmp_path / "good.parquet", {"text": corpus(50)}, 10)
    not_parquet = write_jsonl(tmp_path / "jsonl.parquet", [{"text": "a"}])
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    ints = _write_parquet(tmp_path / "ints.parquet", {"text": list(range(50))})
    chat = ["--format", "chat", "--add-special-tokens", ",".join(CHATML)]
    content_ints = pa.array(
        [[{"role": "user", "content": 1}]],
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())])),
    )
    hub = tmp_path / "hub" / "data"
    _write_parquet(hub / "train-00000-of-00002.parquet", {"text": corpus(20)})
    _write_parquet(hub / "train-00001-of-00002.parquet", {"body": corpus(20)})
    return {
        "not parquet": (not_parquet, [], "not a Parquet file, or a damaged one"),
        "truncated": (truncated, [], "not a Parquet file, or a damaged one"),
        "missing column": (good, ["--json-key", "body"], 'no column "body" (it has "text"; choose the text'),
        "int column": (ints, [], 'column "text" is int64, expected strings'),
        "chat from strings": (good, [*chat, "-k", "text"], 'column "text" is string, expected a list of'),
        "chat, int content": (
            _write_parquet(tmp_path / "ci.parquet", {"messages": content_ints}),
            chat,
            'column "messages" is list<',
        ),
        "second file of a dir": (hub.parent, [], 'no column "text"'),
    }


CASES = ["not parquet", "truncated", "missing column", "int column", "chat from strings", "chat, int content",
         "second file of a dir"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_file_is_one_line_exit_2_nothing_written(tmp_path: Path, sp_model: Path, capsys, case):
    src, args, msg = _bad_files(tmp_path)[case]
    named = src / "data" / "train-00001-of-00002.parquet" if src.is_dir() else src
    for on_error in ("fail", "skip"):  # a bad file is not a bad line: skip does not skip it
        code, err = _cli(capsys, src, tmp_path / "out", "-t", sp_model, *args, "--on-error", on_error)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{named}: {msg}" in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_bad_file_from_the_command(tmp_path: Path, sp_model: Path):
    src, _, msg = _bad_files(tmp_path)["int column"]
    p = run_tool("mega-tokenize", src, tmp_path / "out", "-t", sp_model)
    assert_one_line_error(p, f"{src}: {msg}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize(
    ("value", "msg"), [(None, "is null, expected a string"), (" \n", "is an empty document")]
)
def test_bad_rows_are_bad_lines(tmp_path: Path, sp_model: Path, capsys, value, msg):
    docs = corpus(60)
    rows = [*docs[:47], value, *docs[47:]]
    src = _write_parquet(tmp_path / "c.parquet", {"text": rows}, 10)
    code, err = _cli(capsys, src, tmp_path / "out", "-t", sp_model)
    assert code == 2 and err.count("\n") == 1, err
    assert f'{src}: row 48: column "text" {msg}' in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    code, err = _cli(capsys, src, tmp_path / "out", "-t", sp_model, "--on-error", "skip")
    assert code == 0, err
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.counts.skipped_lines == 1 and m.counts.documents == 60
    assert m.counts.skipped_examples[0].startswith(f'{src}: row 48: column "text" {msg}')
    _tok(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])], sp_model, "jsonl")
    for rel in ("shards/text.bin", "shards/text.idx"):
        assert (tmp_path / "out" / rel).read_bytes() == (tmp_path / "jsonl" / rel).read_bytes()


def test_bad_conversation_row(tmp_path: Path, sp_model: Path, capsys):
    convs = [[{"role": r, "content": c} for r, c in conv] for conv in CONVS]
    convs.insert(1, [{"role": "wizard", "content": "x"}])
    src = _write_parquet(tmp_path / "chat.parquet", {"messages": convs})
    code, err = _cli(
        capsys,
        src,
        tmp_path / "out",
        "-t",
        sp_model,
        "--format",
        "chat",
        "--add-special-tokens",
        ",".join(CHATML),
    )
    assert code == 2 and f"{src}: row 2: messages[0].role: unknown role 'wizard'" in err, err


def test_read_parquet_batches_by_bytes_across_row_groups(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(inputs, "_PARQUET_READ", 1024)  # record batches of about 1 KB
    docs = corpus(300)
    src = _write_parquet(tmp_path / "c.parquet", {"text": docs, "other": [json.dumps(d) for d in docs]}, 7)
    batches = list(read_parquet(src, ["text"], 8192))
    assert len(batches) > 5 and all(b.columns.keys() == {"text"} for b in batches)
    assert [t for b in batches for t in b.columns["text"]] == docs
    assert [b.first_row for b in batches] == [
        1 + sum(b.nrows for b in batches[:i]) for i in range(len(batches))
    ]
    assert all(b.nbytes >= 8192 for b in batches[:-1])
    # Bounded: a batch stops at the first record batch that reaches the target.
    biggest_read = 1024 + max(len(d.encode()) for d in docs) + 16
    assert max(b.nbytes for b in batches) < 8192 + biggest_read
