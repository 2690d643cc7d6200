"""Hugging Face datasets as input, built here with the `datasets` library itself: a `save_to_disk`
Dataset and DatasetDict (several Arrow files), a local dataset repository (Parquet and jsonl data
files, two configs, two splits, README.md YAML), and the same repository in an offline Hub cache
read as `hf://datasets/ORG/NAME` through huggingface_hub and `datasets`. Each gives shards
byte-identical to those of the same rows written here as jsonl, and records the dataset (path,
revision, subset, split) in the manifest and the recipe; bad input is one line and exit 2 with
nothing written."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec
import pytest
from datasets import Dataset, DatasetDict

from helpers import assert_one_line_error, run_tool
from mega_tokenize.inputs import read_arrow
from mega_tokenize.job import prepare
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts.manifest import InputDataset
from megacore.artifacts.reader import open_artifact
from megacore.errors import UserError
from tokenize_testlib import corpus, write_jsonl

CHATML = ["<|im_start|>", "<|im_end|>"]
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
TEXTS = corpus(400)
# The repository's rows per (config, split), in Parquet files.
ROWS = {
    ("a", "train"): TEXTS[:150],
    ("a", "test"): TEXTS[150:200],
    ("b", "train"): [f"b says: {t}" for t in TEXTS[200:330]],
    ("b", "test"): [f"b tests: {t}" for t in TEXTS[330:]],
}
README = """---
configs:
- config_name: a
  default: true
  data_files:
  - split: train
    path: data/a/train-*.parquet
  - split: test
    path: data/a/test-*.parquet
- config_name: b
  data_files:
  - split: train
    path: data/b/train-*.parquet
  - split: test
    path: data/b/test-*.parquet
---
# A test dataset
"""


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch) -> None:
    """`datasets` keeps a builder's lock files in its cache even when streaming: this test's own."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def _card(config: str, train: str) -> str:
    """A dataset card declaring one config of one split, train, in the files `train` matches."""
    return (
        f"---\nconfigs:\n- config_name: {config}\n  data_files:\n  - split: train\n    path: {train}\n---\n"
    )


def _tok(tmp_path: Path, inputs: list, tokenizer: Path, out: str, **kw):
    opts = Options(
        inputs=[str(i) for i in inputs],
        out=tmp_path / out,
        tokenizer=tokenizer,
        progress=False,
        batch_bytes=4096,  # many batches: some inside an Arrow record batch or a table, some across
        **kw,
    )
    return tokenize(opts).manifest


def _same_artifact(a: Path, b: Path) -> None:
    """Byte-identical shards and equal manifests apart from the inputs, dataset, recipe and time."""
    shards = sorted(p.name for p in (a / "shards").iterdir())
    assert shards == sorted(p.name for p in (b / "shards").iterdir())
    for name in shards:
        assert (a / "shards" / name).read_bytes() == (b / "shards" / name).read_bytes(), name
    da, db = (msgspec.structs.asdict(open_artifact(p, "tokens")) for p in (a, b))
    for d in (da, db):
        for k in ("inputs", "dataset", "recipe_sha256", "created_at"):
            d.pop(k)
    assert da == db


def _jsonl(tmp_path: Path, name: str, rows: list[dict], tokenizer: Path, **kw) -> Path:
    """The rows as jsonl, tokenized by the file path: the reference."""
    _tok(tmp_path, [write_jsonl(tmp_path / f"{name}.jsonl", rows)], tokenizer, name, **kw)
    return tmp_path / name


def _split_files(parts: list[list[str]], directory: Path, stem: str) -> None:
    """Rows written by `datasets` as Parquet files `stem-0000k-of-0000n.parquet`, one per part."""
    directory.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(parts):
        path = directory / f"{stem}-{k:05d}-of-{len(parts):05d}.parquet"
        Dataset.from_dict({"text": part, "n": list(range(len(part)))}).to_parquet(str(path))


def _repository(root: Path) -> Path:
    """A dataset repository: two configs of two splits, each split in three Parquet files."""
    for (config, split), rows in ROWS.items():
        cut = len(rows) // 3
        _split_files([rows[:cut], rows[cut : 2 * cut], rows[2 * cut :]], root / "data" / config, split)
    (root / "README.md").write_text(README)
    return root


# --- save_to_disk ---------------------------------------------------------------------------------


def test_saved_dataset_and_dataset_dict_equal_jsonl(tmp_path: Path, sp_model: Path):
    titles = [f"title {i}" for i in range(len(TEXTS))]
    ds = Dataset.from_dict({"text": TEXTS, "title": titles, "n": list(range(len(TEXTS)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    DatasetDict({"train": ds.select(range(300)), "test": ds.select(range(300, 400))}).save_to_disk(
        str(tmp_path / "dict"), num_shards={"train": 2, "test": 1}
    )
    rows = [{"text": t, "title": h} for t, h in zip(TEXTS, titles, strict=True)]
    for keys in (["text"], ["text", "title"]):
        ref = _jsonl(tmp_path, "-".join(keys), rows, sp_model, json_keys=keys, workers=2)
        m = _tok(
            tmp_path, [tmp_path / "saved"], sp_model, "saved-" + "-".join(keys), json_keys=keys, workers=2
        )
        _same_artifact(ref, tmp_path / f"saved-{'-'.join(keys)}")
    arrow = [tmp_path / "saved" / f"data-0000{k}-of-00003.arrow" for k in range(3)]
    assert m.dataset == InputDataset(path=str(tmp_path / "saved"), kind="saved")
    assert [i.path for i in m.inputs] == [str(p) for p in arrow]  # state.json's order
    for split, rows_of in (("train", rows[:300]), ("test", rows[300:])):
        ref = _jsonl(tmp_path, f"ref-{split}", rows_of, sp_model)
        m = _tok(tmp_path, [tmp_path / "dict"], sp_model, f"dict-{split}", split=split)
        _same_artifact(ref, tmp_path / f"dict-{split}")
        assert m.dataset == InputDataset(path=str(tmp_path / "dict"), kind="saved", split=split)
        assert all(Path(i.path).parent == tmp_path / "dict" / split for i in m.inputs)


def test_read_arrow_batches_rows_in_order(tmp_path: Path):
    rows = TEXTS * 6  # save_to_disk writes record batches of 1000 rows: three in the one file
    Dataset.from_dict({"text": rows, "other": [t.upper() for t in rows]}).save_to_disk(str(tmp_path / "s"))
    [path] = (tmp_path / "s").glob("*.arrow")
    batches = list(read_arrow(path, ["text"], 8192))
    assert [b.nrows for b in batches] == [1000, 1000, 400]  # one record batch at a time
    assert all(b.columns.keys() == {"text"} for b in batches)
    assert [t for b in batches for t in b.columns["text"]] == rows
    assert [b.first_row for b in batches] == [1, 1001, 2001]
    assert len(list(read_arrow(path, ["text"], 10 << 20))) == 1  # gathered up to the size asked


def test_chat_and_preference_from_datasets(tmp_path: Path, sp_model: Path):
    convs = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i} <s>"},
         {"role": "assistant", "content": f"A {t[:40]}"}]
        for i, t in enumerate(TEXTS[:90])
    ]  # fmt: skip
    chat = {"format": "chat", "add_special_tokens": CHATML}
    DatasetDict({"train": Dataset.from_dict({"conversation": convs})}).save_to_disk(str(tmp_path / "chat"))
    ref = _jsonl(
        tmp_path,
        "chat-ref",
        [{"conversation": c} for c in convs],
        sp_model,
        json_keys=["conversation"],
        **chat,
    )
    m = _tok(tmp_path, [tmp_path / "chat"], sp_model, "chat-out", json_keys=["conversation"], **chat)
    assert m.counts.documents == 90 and m.shards[0].sidecars == {"roles": "shards/chat.roles"}
    _same_artifact(ref, tmp_path / "chat-out")
    # Preference pairs from a repository's jsonl files, through `datasets`.
    pairs = {"prompt": TEXTS[:60], "chosen": TEXTS[60:120], "rejected": TEXTS[120:180]}
    repo = tmp_path / "pairs"
    (repo / "data").mkdir(parents=True)
    Dataset.from_dict(pairs).select(range(25)).to_json(str(repo / "data" / "train-0.jsonl"))
    Dataset.from_dict(pairs).select(range(25, 60)).to_json(str(repo / "data" / "train-1.jsonl"))
    (repo / "README.md").write_text(_card("default", "data/*.jsonl"))
    rows = [dict(zip(pairs, r, strict=True)) for r in zip(*pairs.values(), strict=True)]
    ref = _jsonl(tmp_path, "pairs-ref", rows, sp_model, format="preference")
    m = _tok(tmp_path, [repo], sp_model, "pairs-out", format="preference")
    assert m.counts.pairs == 60
    _same_artifact(ref, tmp_path / "pairs-out")


# --- a dataset repository, read through `datasets` -------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["sp_model", "hf_dir"])
def test_repository_configs_and_splits_equal_jsonl(tmp_path: Path, request, tokenizer: str):
    tok = request.getfixturevalue(tokenizer)
    repo = _repository(tmp_path / "repo")
    cases = [(None, None, "a", "train"), ("a", "test", "a", "test"), ("b", "train", "b", "train"),
             ("b", None, "b", "train"), (None, "test", "a", "test")]  # fmt: skip
    for subset, split, config, resolved in cases:
        name = f"{subset}-{split}"
        ref = _jsonl(tmp_path, f"ref-{name}", [{"text": t} for t in ROWS[config, resolved]], tok, workers=2)
        m = _tok(tmp_path, [repo], tok, name, subset=subset, split=split, workers=2)
        _same_artifact(ref, tmp_path / name)
        assert m.dataset == InputDataset(path=str(repo), kind="repository", subset=config, split=resolved)
        files = sorted((repo / "data" / config).glob(f"{resolved}-*"))
        assert [Path(i.path) for i in m.inputs] == files and len(files) == 3


def test_recipe_holds_the_datasets_identity(tmp_path: Path, sp_model: Path):
    """Subset, split and revision each change the recipe; a rerun with the same ones reuses."""
    repo = _repository(tmp_path / "repo")
    snapshots = tmp_path / "hub" / "datasets--org--name" / "snapshots"
    for commit in (COMMIT_A, COMMIT_B):  # the same files at two commits, as a Hub cache holds them
        _copy_tree(repo, snapshots / commit)

    def recipe(path: Path, **kw) -> str:
        return prepare(Options(inputs=[str(path)], out=tmp_path / "o", tokenizer=sp_model, **kw)).recipe

    recipes = [recipe(repo), recipe(repo, subset="b"), recipe(repo, split="test")]
    recipes += [recipe(snapshots / COMMIT_A), recipe(snapshots / COMMIT_B)]
    assert len(set(recipes)) == len(recipes)
    assert recipe(repo, subset="a", split="train") == recipes[0]  # the defaults, named
    m = _tok(tmp_path, [snapshots / COMMIT_B], sp_model, "snap", subset="b")
    assert m.dataset == InputDataset(
        path=str(snapshots / COMMIT_B), kind="repository", revision=COMMIT_B, subset="b", split="train"
    )
    assert tokenize(Options([str(snapshots / COMMIT_B)], tmp_path / "snap", sp_model, subset="b")).reused


def _copy_tree(src: Path, dst: Path) -> None:
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(src)).write_bytes(f.read_bytes())


def test_bad_rows_name_the_dataset_split_and_row(tmp_path: Path, sp_model: Path):
    repo = tmp_path / "repo"
    rows = [*TEXTS[:47], None, *TEXTS[47:60]]
    (repo / "data").mkdir(parents=True)
    Dataset.from_dict({"text": rows}).to_parquet(str(repo / "data" / "train.parquet"))
    (repo / "README.md").write_text(_card("a", "data/train.parquet"))
    p = run_tool(
        "mega-tokenize", repo, tmp_path / "out", "-t", sp_model, env=_offline(tmp_path / "hf" / "hub")
    )
    assert_one_line_error(
        p, f'{repo} (subset a, split train): row 48: column "text" is null, expected a string'
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    m = _tok(tmp_path, [repo], sp_model, "out", on_error="skip")
    assert m.counts.skipped_lines == 1 and m.counts.documents == 60


# --- the Hub, offline: huggingface_hub finds the snapshot, `datasets` reads it ---------------------


def _hub_cache(root: Path, repo: Path, name: str, commits: list[str], extra: dict | None = None) -> Path:
    """An offline Hugging Face hub cache holding dataset `name` at `commits` (the same files), as
    huggingface_hub lays it out: blobs by sha256, snapshots of symlinks, refs/main the first commit."""
    cache = root / "hf" / "hub"
    d = cache / f"datasets--{name.replace('/', '--')}"
    files = {f.relative_to(repo).as_posix(): f.read_bytes() for f in repo.rglob("*") if f.is_file()}
    for rel, data in {**files, **(extra or {})}.items():
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        for commit in commits:
            link = d / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(commits[0])
    return cache


def _offline(cache: Path) -> dict:
    home = cache.parent
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(home / "datasets")}  # fmt: skip


def test_hub_dataset_read_offline_from_the_hub_cache(tmp_path: Path, sp_model: Path):
    cache = _hub_cache(tmp_path, _repository(tmp_path / "repo"), "org/name", [COMMIT_A, COMMIT_B])
    env = _offline(cache)
    ref = _jsonl(tmp_path, "ref", [{"text": t} for t in ROWS["b", "test"]], sp_model)
    args = ["-t", sp_model, "--subset", "b", "--split", "test", "--no-progress"]
    run_tool("mega-tokenize", "hf://datasets/org/name", tmp_path / "out", *args, env=env, check=True)
    _same_artifact(ref, tmp_path / "out")
    m = open_artifact(tmp_path / "out", "tokens")
    assert m.dataset == InputDataset(
        path="hf://datasets/org/name", kind="hub", revision=COMMIT_A, subset="b", split="test"
    )
    snapshot = cache / "datasets--org--name" / "snapshots" / COMMIT_A
    assert [i.path for i in m.inputs] == [str(p) for p in sorted((snapshot / "data" / "b").glob("test-*"))]
    again = run_tool("mega-tokenize", "hf://datasets/org/name", tmp_path / "out", *args, env=env, check=True)
    assert "reused" in again.stderr
    # main moved to another commit of the same files: another recipe, not reused, replaced only
    # with --force; a commit named with @ is read as well.
    (cache / "datasets--org--name" / "refs" / "main").write_text(COMMIT_B)
    p = run_tool("mega-tokenize", "hf://datasets/org/name", tmp_path / "out", *args, env=env)
    assert p.returncode == 2 and "--force" in p.stderr, p.stderr
    run_tool(
        "mega-tokenize", "hf://datasets/org/name", tmp_path / "out", *args, "--force", env=env, check=True
    )
    assert open_artifact(tmp_path / "out", "tokens").dataset.revision == COMMIT_B
    _same_artifact(ref, tmp_path / "out")
    run_tool(
        "mega-tokenize", f"hf://datasets/org/name@{COMMIT_A}", tmp_path / "at-a", *args, env=env, check=True
    )
    assert open_artifact(tmp_path / "at-a", "tokens").dataset.revision == COMMIT_A


# --- bad input: one line, exit 2, nothing written --------------------------------------------------


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[str, list[str], str]]:
    """case -> (input, extra arguments, what the one line says, after the input named)."""
    repo = _repository(tmp_path / "repo")
    script = tmp_path / "scripted"
    script.mkdir()
    (script / "scripted.py").write_text("import datasets  # a loading script\n")
    (script / "README.md").write_text("# needs its script\n")
    _hub_cache(tmp_path, repo, "org/name", [COMMIT_A])
    _hub_cache(tmp_path, repo, "org/scripted", [COMMIT_A], extra={"scripted.py": b"import datasets\n"})
    d = Dataset.from_dict({"text": TEXTS[:20]})
    DatasetDict({"train": d, "test": d}).save_to_disk(str(tmp_path / "dict"))
    hub = "hf://datasets/org/name"
    return {
        "hub: no such dataset": ("hf://datasets/org/nope", [], "Couldn't reach 'org/nope' on the Hub"),
        "hub: no such split": (hub, ["--split", "validation"], "Bad split: validation. Available splits"),
        "hub: a loading script": ("hf://datasets/org/scripted", [], "needs remote code (its loading script scripted.py)"),
        "repository: no such config": (str(repo), ["--subset", "c"], "BuilderConfig 'c' not found. Available: ['a', 'b']"),
        "repository: no such column": (str(repo), ["-k", "body"], f'{repo} (subset a, split train): no column "body"'),
        "repository: a loading script": (str(script), [], "needs remote code (its loading script scripted.py)"),
        "saved: no such split": (str(tmp_path / "dict"), ["--split", "dev"], 'no split "dev" (it has "train", "test"'),
        "saved: chat from strings": (str(tmp_path / "dict"), ["--format", "chat", "-k", "text"], 'column "text" is string'),
    }  # fmt: skip


CASES = ["hub: no such dataset", "hub: no such split", "hub: a loading script", "repository: no such config",
         "repository: no such column", "repository: a loading script", "saved: no such split",
         "saved: chat from strings"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_dataset_input_is_one_line_exit_2(tmp_path: Path, sp_model: Path, case: str):
    src, args, msg = _bad_inputs(tmp_path)[case]
    env = _offline(tmp_path / "hf" / "hub")
    p = run_tool("mega-tokenize", src, tmp_path / "out", "-t", sp_model, *args, env=env)
    assert_one_line_error(p, src, msg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_without_the_datasets_extra(tmp_path: Path, sp_model: Path):
    """Without `datasets`, a repository or Hub input says which extra to install; a save_to_disk
    directory needs only pyarrow."""
    shim = tmp_path / "shim" / "datasets"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n"
    )
    env = {**_offline(tmp_path / "hf" / "hub"), "PYTHONPATH": str(shim.parent)}
    repo = _repository(tmp_path / "repo")
    for src in ("hf://datasets/org/name", str(repo)):
        p = run_tool("mega-tokenize", src, tmp_path / "out", "-t", sp_model, env=env)
        assert_one_line_error(
            p,
            f"{src}: reading this dataset needs the datasets library: pip install 'mega-tokenize[datasets]'",
        )
    Dataset.from_dict({"text": TEXTS[:30]}).save_to_disk(str(tmp_path / "saved"))
    run_tool("mega-tokenize", tmp_path / "saved", tmp_path / "out", "-t", sp_model, env=env, check=True)
    assert open_artifact(tmp_path / "out", "tokens").counts.documents == 30


def test_usage_errors(tmp_path: Path, sp_model: Path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    Dataset.from_dict({"text": TEXTS[:5]}).save_to_disk(str(tmp_path / "saved"))
    no_default = _repository(tmp_path / "no-default")
    (no_default / "README.md").write_text(README.replace("  default: true\n", ""))
    cases = [
        (
            [no_default],
            {},
            "Config name is missing. Please pick one among the available configs: ['a', 'b'] (choose",
        ),
        ([src], {"split": "train"}, "--split: chooses within a Hugging Face dataset"),
        ([tmp_path / "saved", src], {}, f"{tmp_path / 'saved'}: a Hugging Face dataset is read alone"),
        ([tmp_path / "saved"], {"split": "test"}, "this is one Dataset (no split name), not a DatasetDict"),
        ([tmp_path / "saved"], {"subset": "x"}, "has no subsets; drop --subset"),
        (["hf://models/org/x"], {}, "hf://models/org/x: expected hf://datasets/ORG/NAME"),
    ]
    for inputs, kw, msg in cases:
        with pytest.raises(UserError) as e:
            _tok(tmp_path, inputs, sp_model, "o", **kw)
        assert msg in str(e.value), e.value
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="the output lies inside the input"):
        _tok(tmp_path, [tmp_path / "saved"], sp_model, "saved/tokens")
