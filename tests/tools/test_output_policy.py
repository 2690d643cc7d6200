"""The one output policy, tool by tool: every case of megacore.artifacts.output for all five tools.

For each tool a real input is made once (a corpus directory and tokenizer, a Hugging Face model, a
checkpoint, a checkpoint, a live model in a one-process gloo group for mega-train's checkpoint
saves) and the tool is pointed at an output that is: a directory of the user's, a file, the input
itself, a path inside the input, a directory containing the input, a complete output of its own
(reused, replaced with --force, refused with other settings, refused with a user's file added), an
artifact of another kind, a leftover staging directory of a killed run (cleaned) or one it did
not make (refused), each with and without --force. In every refused case the existing data is
byte-identical afterwards; in every allowed case the output is complete and nothing is left beside
it.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import TINY, write_checkpoint
from hf_cases import build
from mega_export.cli import app as export_app
from megacore.artifacts import MANIFEST_NAME, open_artifact
from megacore.artifacts.writer import STAGING_MARK
from megacore.cli import run as run_cli
from megacore.errors import UserError
from megacore.parts import model_tensors
from tokenize_testlib import corpus, write_jsonl

TOOLS = ["mega-tokenize", "mega-convert", "mega-shard", "mega-export", "mega-train"]
KIND = {"mega-tokenize": "tokens", "mega-export": "hf"}


def snapshot(path: Path) -> dict[str, bytes | str]:
    """Every file (bytes), directory and link under `path` (or `path` itself): what must not change."""
    if path.is_file() or path.is_symlink():
        return {".": path.read_bytes() if path.is_file() else f"-> {os.readlink(path)}"}
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


@dataclass
class Outcome:
    code: int
    err: str


@dataclass
class Tool:
    name: str
    input: Path
    call: Callable[[Path, bool, bool], Outcome]  # (out, force, other_settings)

    def __call__(self, out: Path, force: bool = False, other: bool = False) -> Outcome:
        return self.call(out, force, other)


def cli(capsys, app, prog: str, *args: object) -> Outcome:
    capsys.readouterr()
    code = run_cli(app, prog, [str(a) for a in args])
    return Outcome(code, capsys.readouterr().err)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, sp_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    (root / "corpus").mkdir()
    write_jsonl(root / "corpus" / "c.jsonl", [{"text": d} for d in corpus(20)])
    g = torch.Generator().manual_seed(0)
    write_checkpoint(root / "ckpt", {n: torch.randn(s, generator=g) for n, s in model_tensors(TINY).items()})
    return {
        "corpus": root / "corpus",
        "tokenizer": sp_model,
        "hf": build("llama", root / "hf"),
        "ckpt": root / "ckpt",
    }


@pytest.fixture(scope="module")
def live_model():
    """A one-process gloo group and a tiny ParallelModel: what mega-train saves checkpoints from."""
    import torch.distributed as dist

    from megacore.parallel.engine import ParallelModel
    from megacore.parallel.layout import Parallelism
    from megacore.parallel.mesh import build_mesh, shutdown

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mesh = build_mesh()
        pm = ParallelModel(TINY, Parallelism(precision="fp32"), mesh, "cpu")
        pm.init_weights()
        yield pm
    finally:
        if dist.is_initialized():
            shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The command line of each tool: (input key, arguments for OUT, with the other settings or not).
COMMANDS: dict[str, tuple[str, Callable[[dict, Path, bool], list]]] = {
    "mega-tokenize": (
        "corpus",
        lambda i, out, other: (
            [i["corpus"], out, "-t", i["tokenizer"], "--no-progress"] + (["--no-append-eos"] if other else [])
        ),
    ),
    "mega-convert": (
        "hf",
        lambda i, out, other: ["hf", i["hf"], out] + (["--dtype", "bfloat16"] if other else []),
    ),
    "mega-shard": ("ckpt", lambda i, out, other: [i["ckpt"], out, "--tp", "2" if other else "1"]),
    "mega-export": (
        "ckpt",
        lambda i, out, other: [i["ckpt"], out] + (["--dtype", "bfloat16"] if other else []),
    ),
}


@pytest.fixture
def tool(request, inputs, capsys) -> Tool:
    name = request.param
    if name in COMMANDS:
        app = importlib.import_module(f"{name.replace('-', '_')}.cli").app
        key, args = COMMANDS[name]

        def call(out: Path, force: bool, other: bool) -> Outcome:
            return cli(capsys, app, name, *args(inputs, out, other), *(["--force"] if force else []))

        return Tool(name, inputs[key], call)
    # mega-train writes checkpoints from a live model (its training loop will call this).
    from megacore.parallel.checkpoint_io import save_checkpoint

    pm = request.getfixturevalue("live_model")

    def save(out: Path, force: bool, other: bool) -> Outcome:
        try:
            save_checkpoint(out, pm, force=force, inputs=[inputs["ckpt"]])
        except UserError as e:
            return Outcome(2, f"mega-train: error: {e}\n")
        return Outcome(0, "")

    return Tool(name, inputs["ckpt"], save)


def refused(
    tool: Tool, out: Path, *fragments: str, force: bool = False, other: bool = False, keep: Path | None = None
) -> None:
    """The tool refuses `out` (exit 2, one line naming it) and everything at `keep` stays identical."""
    keep = keep or out
    before = snapshot(keep)
    input_before = snapshot(tool.input)
    r = tool(out, force=force, other=other)
    assert r.code == 2, r
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err, r.err
    for f in fragments:
        assert f in r.err, (f, r.err)
    assert snapshot(keep) == before
    assert snapshot(tool.input) == input_before
    assert not out.with_name(out.name + ".partial").exists() or keep == out.with_name(out.name + ".partial")


def complete(tool: Tool, out: Path) -> None:
    """A complete output of the tool's kind, and nothing staged beside it."""
    kind = KIND.get(tool.name, "checkpoint")
    open_artifact(out, kind)
    assert not out.with_name(out.name + ".partial").exists()
    assert not list(out.parent.glob(f"{out.name}.replaced-*"))


by_tool = pytest.mark.parametrize("tool", TOOLS, indirect=True)
with_force = pytest.mark.parametrize("force", [False, True], ids=["", "force"])


@by_tool
@with_force
def test_a_directory_of_the_user_is_never_replaced(tool: Tool, tmp_path: Path, force: bool):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    refused(tool, tmp_path / "mine", "is not an artifact", force=force)


@by_tool
@with_force
def test_an_existing_file_is_refused(tool: Tool, tmp_path: Path, force: bool):
    (tmp_path / "out").write_text("a file of mine")
    refused(tool, tmp_path / "out", "not a directory", force=force)


@by_tool
@with_force
def test_the_input_itself_is_refused(tool: Tool, force: bool):
    refused(tool, tool.input, "is the input", force=force, keep=tool.input)


@by_tool
@with_force
def test_a_path_inside_the_input_is_refused(tool: Tool, force: bool):
    refused(tool, tool.input / "out", "inside the input", force=force, keep=tool.input)
    assert not (tool.input / "out").exists()


@by_tool
@with_force
def test_a_directory_containing_the_input_is_refused(tool: Tool, force: bool):
    refused(tool, tool.input.parent, "contains the input", force=force, keep=tool.input.parent)


@by_tool
def test_a_previous_complete_output(tool: Tool, tmp_path: Path):
    out = tmp_path / "out"
    assert tool(out).code == 0
    complete(tool, out)
    if tool.name != "mega-train":  # same inputs and settings: reused as it is
        before = snapshot(out)
        r = tool(out)
        assert r.code == 0 and "reus" in r.err, r.err
        assert snapshot(out) == before
        # Other settings: refused without --force, replaced with it.
        refused(tool, out, "--force", other=True)
        assert tool(out, force=True, other=True).code == 0
    else:  # a training job's checkpoint save has no recipe: an existing one needs force
        refused(tool, out, "--force")
    assert tool(out, force=True).code == 0
    complete(tool, out)


@by_tool
def test_a_symlinked_output_is_written_where_it_points(tool: Tool, tmp_path: Path):
    """An output linked to big storage stays a link: the artifact appears at its target."""
    (tmp_path / "storage").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "storage")
    assert tool(tmp_path / "out").code == 0
    assert (tmp_path / "out").is_symlink()
    complete(tool, tmp_path / "storage")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "storage"]


@by_tool
def test_a_user_file_inside_a_previous_output_is_never_deleted(tool: Tool, tmp_path: Path):
    out = tmp_path / "out"
    assert tool(out).code == 0
    (out / "notes.txt").write_text("my notes")
    refused(tool, out, "notes.txt", force=True, other=True)


@by_tool
@with_force
def test_an_artifact_of_another_kind_is_refused(tool: Tool, tmp_path: Path, inputs, force: bool):
    other = tmp_path / "other"
    if tool.name in ("mega-tokenize", "mega-export"):
        shutil.copytree(inputs["ckpt"], other)  # a checkpoint where tokens / an HF export would go
        kind = "checkpoint"
    else:
        assert run_cli(export_app, "mega-export", [str(inputs["ckpt"]), str(other)]) == 0
        kind = "hf"
    refused(tool, other, f"is a {kind} artifact", force=force)


@by_tool
def test_a_leftover_of_a_killed_run_is_cleaned(tool: Tool, tmp_path: Path):
    out = tmp_path / "out"
    stage = tmp_path / "out.partial"
    (stage / "shards").mkdir(parents=True)
    (stage / "shards" / "half.bin").write_bytes(b"half written")
    gone = subprocess.Popen(["true"])
    gone.wait()
    (stage / STAGING_MARK).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    assert tool(out).code == 0
    complete(tool, out)


@by_tool
@with_force
def test_a_staging_directory_it_did_not_make_is_refused(tool: Tool, tmp_path: Path, force: bool):
    stage = tmp_path / "out.partial"
    stage.mkdir()
    (stage / "data.txt").write_text("someone's data")
    refused(tool, tmp_path / "out", "was not made by these tools", force=force, keep=stage)
    assert not (tmp_path / "out").exists()


@by_tool
def test_a_staging_directory_a_live_run_is_writing_is_refused(tool: Tool, tmp_path: Path):
    stage = tmp_path / "out.partial"
    stage.mkdir()
    with subprocess.Popen(["sleep", "60"]) as live:
        try:
            (stage / STAGING_MARK).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
            refused(tool, tmp_path / "out", f"another run (pid {live.pid})", force=True, keep=stage)
        finally:
            live.kill()


def test_every_tool_is_in_the_table():
    """A sixth tool that writes artifacts must join this table."""
    tools = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "tools").iterdir() if p.is_dir())
    assert tools == sorted(TOOLS)
    assert MANIFEST_NAME == "manifest.json"
