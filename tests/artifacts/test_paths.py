"""Every path field of every manifest schema is typed and checked in one place.

The schemas in schemas/ mark each path field with `x-path` (file, prefix, ref or record). This walks
every schema, finds every such field, and for each `file` and `prefix` field of a real artifact of
each kind points it at an absolute path, a `..` escape, a symlink out of the artifact and a file
the artifact does not list: `open_artifact` refuses each, naming the field. `record` paths are
never opened; `ref` paths (run manifests) resolve against the manifest's directory. A string
field whose name says it is a path but that carries no `x-path` fails the test, so a path field
added later cannot escape the check.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from helpers import TINY, write_checkpoint
from mega_export.export import export_hf
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts import MANIFEST_NAME, open_artifact
from megacore.artifacts.manifest import TrainedTokenizer, TrainingState
from megacore.artifacts.reader import path_fields
from megacore.errors import UserError
from megacore.parts import model_tensors
from tokenize_testlib import write_jsonl

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
PATHY = re.compile(r"(^|_)(path|prefix|file|files|dir|init|sidecars)$")


def _leaves(schema: dict, defs: dict, path: str, seen: tuple = ()):
    """(dotted property path, leaf schema) of every string-typed leaf, through $ref, arrays, maps."""
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        if name in seen:
            return
        yield from _leaves(defs[name], defs, path, (*seen, name))
        return
    for sub in schema.get("anyOf", []):
        yield from _leaves(sub, defs, path, seen)
    if schema.get("type") == "string":
        yield path, schema
    if "items" in schema:
        yield from _leaves(schema["items"], defs, path, seen)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _leaves(schema["additionalProperties"], defs, path, seen)
    for prop, sub in schema.get("properties", {}).items():
        yield from _leaves(sub, defs, f"{path}.{prop}" if path else prop, seen)


def schema_paths(kind: str) -> dict[str, str]:
    """Dotted field path -> x-path kind, for every path field of a manifest kind's schema."""
    schema = json.loads((SCHEMAS / f"{kind}.schema.json").read_text())
    out = {}
    for dotted, leaf in _leaves(schema, schema["$defs"], ""):
        if "x-path" in leaf:
            out[dotted] = leaf["x-path"]
        else:
            assert not PATHY.search(dotted.split(".")[-1]), (
                f"{kind}: {dotted} looks like a path but has no x-path"
            )
    return out


def dotted(jsonpath: str) -> str:
    """`$.tensors["embed.weight"].pieces[0].file` -> `tensors.pieces.file`."""
    return re.sub(r'\["[^"]*"\]|\[\d+\]', "", jsonpath).removeprefix("$.")


def test_every_kind_has_its_path_fields_typed():
    kinds = sorted(p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json"))
    assert kinds == ["checkpoint", "hf", "run", "tokens"]
    assert schema_paths("tokens") == {
        "parents.path": "record",
        "files.path": "file",
        "tokenizer.files": "file",
        "inputs.path": "record",
        "dataset.path": "record",
        "shards.prefix": "prefix",
        "shards.sidecars": "prefix",
        "shards.columns": "file",
    }
    assert schema_paths("checkpoint") == {
        "parents.path": "record",
        "files.path": "file",
        "tensors.pieces.file": "file",
        "tokenizer_files": "file",
        "tokenizer.info.files": "file",
        "training.rng_files": "file",
        "adapter.base.path": "record",
        "adapter.base.relative": "ref",
        "adapter.base.hf_source.path": "record",
        "hf_source.path": "record",
    }
    assert schema_paths("hf") == {"parents.path": "record", "files.path": "file"}
    assert schema_paths("run") == {
        "parents.path": "record",
        "files.path": "file",
        "out": "ref",
        "model.init": "ref",
        "model.hf_config": "ref",
        "data.sources.path": "ref",
        "checkpoint.dir": "ref",
        "lora.init": "ref",
        "eval.task_paths": "ref",
    }


# --- real artifacts of every kind, with every path field in use --------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, sp_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3
    # Prompts: a roles sidecar and a columns file beside the shard, every path field of tokens.
    prompts = [{"prompt": chat["messages"][:1], "answer": "hello"} for chat in chats]
    for name, rows, form in (("chat", chats, "chat"), ("tokens", prompts, "prompts")):
        opts = Options(
            inputs=[str(write_jsonl(root / f"{name}.jsonl", rows))],
            out=root / name,
            tokenizer=sp_model,
            format=form,
            add_special_tokens=["<|im_start|>", "<|im_end|>"],
            progress=False,
        )
        tokenize(opts, log=lambda _: None)
    g = torch.Generator().manual_seed(0)
    config = msgspec.structs.replace(TINY, vocab_size=512, padded_vocab_size=512)  # room for 402 ids
    info = open_artifact(root / "tokens", "tokens").tokenizer
    write_checkpoint(
        root / "ckpt",
        {n: torch.randn(s, generator=g) for n, s in model_tensors(config).items()},
        config=config,
        side_files={
            "tokenizer/tokenizer.model": sp_model.read_bytes(),
            "tokenizer/trained.model": sp_model.read_bytes(),
            "rng/rank0.bin": b"rng",
        },
        tokenizer_files=["tokenizer/tokenizer.model"],
        tokenizer=TrainedTokenizer(
            msgspec.structs.replace(info, files=["tokenizer/trained.model"]), "chatml"
        ),
        training=TrainingState(step=1, rng_files=["rng/rank0.bin"]),
    )
    export_hf(root / "ckpt", root / "hf")
    return {"tokens": root / "tokens", "chat": root / "chat", "checkpoint": root / "ckpt", "hf": root / "hf"}


def _set(doc: dict, jsonpath: str, value: str) -> None:
    parts = re.findall(r'\.(\w+)|\[(\d+)\]|\["([^"]*)"\]', jsonpath)
    node = doc
    keys = [int(i) if i else (a or k) for a, i, k in parts]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


BAD = [
    ("/etc/passwd", "is absolute"),
    ("../outside", "leaves the artifact directory"),
    ("escape", "resolves outside the artifact"),
    ("no-such-file", "names no file of the artifact"),
]


@pytest.mark.parametrize("kind", ["tokens", "checkpoint", "hf"])
def test_every_file_and_prefix_field_is_confined(kind: str, artifacts, tmp_path: Path):
    original = artifacts[kind]
    manifest = open_artifact(original, kind)
    hits = list(path_fields(manifest))
    declared = {p for p, k in schema_paths(kind).items() if k in ("file", "prefix")}
    assert {dotted(at) for at, k, _ in hits if k in ("file", "prefix")} == declared, (
        "a path field is not exercised"
    )
    outside = tmp_path / "secret"
    outside.write_bytes(b"not the artifact's")
    checked = 0
    for at, path_kind, _ in hits:
        if path_kind not in ("file", "prefix"):
            continue
        for value, message in BAD:
            if dotted(at) == "files.path" and value == "no-such-file":
                continue  # $.files defines what is listed; a missing file there is verify's error
            work = tmp_path / "a"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(original, work, symlinks=True)
            for name in ("escape", "escape.bin", "escape.idx"):
                (work / name).symlink_to(outside)
            doc = json.loads((work / MANIFEST_NAME).read_text())
            _set(doc, at, value)
            (work / MANIFEST_NAME).write_text(json.dumps(doc))
            with pytest.raises(UserError, match=re.escape(message)) as e:
                open_artifact(work, kind, verify="none")
            assert at in str(e.value), (at, str(e.value))
            checked += 1
    assert checked >= 3 * len(declared)


_OPENED: list[list[str]] = []  # while `opened_paths` runs: every path the process opens or lists


def _audit(event: str, args: tuple) -> None:
    if (
        _OPENED
        and event in ("open", "os.listdir", "os.scandir")
        and isinstance(args[0], str | bytes | os.PathLike)
    ):
        _OPENED[-1].append(os.fsdecode(args[0]))


@functools.cache
def _install_audit_hook() -> None:
    sys.addaudithook(_audit)  # for the life of the process; it records nothing outside `opened_paths`


@contextlib.contextmanager
def opened_paths() -> Iterator[list[Path]]:
    """The paths the process opens (builtin `open`, `os.open`) or lists (`os.listdir`, `os.scandir`)
    inside the block, as Python's audit events report them, made absolute and resolved."""
    _install_audit_hook()
    seen: list[str] = []
    resolved: list[Path] = []
    _OPENED.append(seen)
    try:
        yield resolved
    finally:
        _OPENED.pop()
        resolved += [Path(os.path.abspath(p)).resolve() for p in seen]


@pytest.mark.parametrize("kind", ["tokens", "checkpoint", "hf"])
def test_record_paths_are_never_opened(kind: str, artifacts, tmp_path: Path, monkeypatch):
    """A record path says where a parent or an input was: history, not a file of the artifact.
    Record paths that a `file` field would refuse (absolute through `..`, a relative `..` escape,
    one naming nothing) and that name, from the artifact's directory (the working directory too), a
    real directory and file outside it whose contents fail any reading (a manifest that is not
    JSON): `open_artifact`, every file's sha256 verified, accepts them, hands them back as written,
    and opens or lists nothing under them, while it is seen opening the artifact's own manifest."""
    decoy = tmp_path / "elsewhere"
    (decoy / "parent").mkdir(parents=True)
    (decoy / "parent" / MANIFEST_NAME).write_text("not a manifest")
    (decoy / "input.jsonl").write_text("not an input\n")
    work = tmp_path / "a"
    shutil.copytree(artifacts[kind], work)
    doc = json.loads((work / MANIFEST_NAME).read_text())
    parents = [f"{decoy}/../{decoy.name}/parent", f"../{decoy.name}/parent", "/no/such/../place"]
    doc["parents"] = [{"path": p, "kind": "checkpoint", "manifest_sha256": "0" * 64} for p in parents]
    want = {f"$.parents[{i}].path": p for i, p in enumerate(parents)}
    for i, item in enumerate(doc.get("inputs", [])):
        item["path"] = want[f"$.inputs[{i}].path"] = f"../{decoy.name}/input.jsonl"
    assert (kind == "tokens") == ("$.inputs[0].path" in want), "the tokens artifact records its inputs"
    (work / MANIFEST_NAME).write_text(json.dumps(doc))
    monkeypatch.chdir(work)
    with opened_paths() as seen:
        manifest = open_artifact(work, kind, verify="sha256")
    assert {at: value for at, k, value in path_fields(manifest) if k == "record"} == want
    assert (work / MANIFEST_NAME).resolve() in seen, seen  # the audit hook sees the reader's opens
    assert [p for p in seen if p.is_relative_to(decoy.resolve())] == []


def test_run_refs_resolve_against_the_manifest_not_the_working_directory(
    artifacts, tmp_path: Path, monkeypatch
):
    from mega_train.run_plan import plan_run

    runs = tmp_path / "runs" / "exp1"
    runs.mkdir(parents=True)
    shutil.copytree(artifacts["checkpoint"], tmp_path / "ckpt")
    run = {
        "kind": "run",
        "format_version": 1,
        "out": "run-out",
        "model": {"init": "../../ckpt"},
        "data": {"sources": [{"path": str(artifacts["chat"])}]},  # absolute paths are kept
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 8},
        "train_steps": 1,
    }
    (runs / "run.json").write_text(json.dumps(run))
    monkeypatch.chdir(tmp_path / "runs")  # the relative path would miss from here
    # Resolved against the manifest's directory: the checkpoint two levels up is the one found.
    assert plan_run(runs / "run.json", 1).init[0].resolve() == (tmp_path / "ckpt").resolve()
    with pytest.raises(UserError, match="no such artifact directory"):
        run["model"]["init"] = "../ckpt"
        (runs / "run.json").write_text(json.dumps(run))
        plan_run(runs / "run.json", 1)
