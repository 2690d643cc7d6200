"""What every tool shares: --help, --version, exit codes and one-line errors on bad manifests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_one_line_error, run_tool
from mega_train.cli import app as train_app
from megacore.artifacts import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    TokensManifest,
    new_header_fields,
    write_artifact,
)
from megacore.artifacts.manifest import Shard, TokenCounts, TokenizerInfo
from megacore.cli import run as run_cli
from megacore.data.indexed import IndexedWriter

TOOLS = ["mega-tokenize", "mega-convert", "mega-shard", "mega-train", "mega-export"]


@pytest.mark.parametrize("tool", TOOLS)
def test_help_and_version(tool: str):
    h = run_tool(tool, "--help")
    assert h.returncode == 0 and "Usage:" in h.stdout, h.stderr
    v = run_tool(tool, "--version")
    assert v.returncode == 0 and v.stdout.strip() == f"{tool} 0.1.0"


def dry_run(capsys, *argv: object) -> subprocess.CompletedProcess:
    """mega-train in this process (the CLI's own code path without the interpreter start-up)."""
    code = run_cli(train_app, "mega-train", [str(a) for a in argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["mega-train", *map(str, argv)], code, out, err)


def test_usage_error_is_exit_2_one_line():
    assert_one_line_error(
        run_tool("mega-train", "--manifest", "x.json", "--bogus"), "No such option: --bogus"
    )


def _tokens_artifact(out: Path, vocab_size: int = 32000) -> None:
    """A small real tokens artifact: 20 documents of 50 ids in one Megatron shard."""
    with write_artifact(out, "tokens") as w:
        w.path("tokenizer/tokenizer.model").write_bytes(b"not used by the dry run")
        shard = IndexedWriter(w.path("shards/text"), "uint16")
        shard.add(np.arange(1000, dtype=np.uint16) % vocab_size, np.full(20, 50))
        shard.close()
        tok = TokenizerInfo(
            type="sentencepiece", files=["tokenizer/tokenizer.model"], vocab_size=vocab_size, fingerprint="x"
        )
        shards = [Shard(prefix="shards/text", json_key="text", documents=20, tokens=1000)]
        counts = TokenCounts(documents=20, tokens=1000)
        w.commit(
            TokensManifest(
                **new_header_fields("tests", "0"), tokenizer=tok, dtype="uint16", shards=shards, counts=counts
            )
        )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    _tokens_artifact(tmp_path / "tokens")
    run = {
        "kind": "run",
        "format_version": 1,
        "out": "run-out",
        "model": {
            "config": {
                "family": "llama",
                "vocab_size": 32000,
                "hidden_size": 64,
                "num_layers": 4,
                "num_heads": 4,
                "num_kv_heads": 2,
                "ffn_hidden_size": 128,
            }
        },
        "data": {"sources": [{"path": "tokens"}]},
        "batch": {"micro_batch_size": 2, "global_batch_size": 16, "seq_length": 64},
        "train_steps": 10,
        "parallel": {"tp": 2, "pp": 2},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    return tmp_path


def _patch(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_dry_run_accepts_a_good_manifest(run_dir: Path, capsys):
    p = dry_run(capsys, "--manifest", run_dir / "run.json", "--dry-run", "--world-size", "8", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["parallel"] == {"world_size": 8, "tp": 2, "pp": 2, "cp": 1, "dp": 2, "ep": 1}
    assert plan["batch"]["grad_accum"] == 4


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda d: d["parallel"].update(tp="2"), ["run.json: $.parallel.tp: expected int, got str"]),
        (lambda d: d["parallel"].update(tq=2), ["run.json: $.parallel: object contains unknown field tq"]),
        (
            lambda d: d.update(format_version=99),
            ["$.format_version: 99 is newer than this megacore supports"],
        ),
        (lambda d: d["parallel"].update(tp=3), ["$.parallel.tp: tp 3 does not divide the 4 attention heads"]),
        (lambda d: d["parallel"].update(tp=1, pp=3), ["world size 8 is not a multiple of tp*pp = 1*3"]),
        (lambda d: d["batch"].update(global_batch_size=6), ["$.batch.global_batch_size"]),
        (
            lambda d: d["parallel"].update(tp=8, pp=1),
            ["$.parallel.tp: tp 8 does not divide the 4 attention heads"],
        ),
        (lambda d: d["parallel"].update(pp=8, tp=1), ["$.parallel.pp", "8"]),
        (lambda d: d.update(train_steps=-5), ["run.json: $.train_steps: expected int >= 1"]),
        (lambda d: d["batch"].update(micro_batch_size=0), ["$.batch.micro_batch_size: expected int >= 1"]),
        (lambda d: d["batch"].update(micro_batch_size=-2), ["$.batch.micro_batch_size: expected int >= 1"]),
        (
            lambda d: d["batch"].update(seq_length=100_000),
            ["$.batch.seq_length: 100000 exceeds the model's max_seq_len 4096"],
        ),
        (lambda d: d.update(optimizer={"lr": 1e-4, "min_lr": 1e-3}), ["$.optimizer.min_lr"]),
        (
            lambda d: d["model"]["config"].update(num_kv_heads=3),
            ["$.model.config", "not a multiple of the kv heads 3"],
        ),
    ],
)
def test_bad_run_manifest(run_dir: Path, edit, fragments: list[str], capsys):
    _patch(run_dir / "run.json", edit)
    p = dry_run(capsys, "--manifest", run_dir / "run.json", "--dry-run", "--world-size", "8")
    assert_one_line_error(p, *fragments)
    # Every run-manifest error starts with the manifest's name, then the field.
    assert p.stderr.startswith(f"mega-train: error: {run_dir / 'run.json'}: "), p.stderr


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda d: d["files"][0].update(path="/etc/passwd"), ["$.files[0]", "is absolute"]),
        (lambda d: d["files"][0].update(path="../run.json"), ["$.files[0]", "leaves the artifact directory"]),
        (lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1), ["differs from the manifest's"]),
        (
            lambda d: d.update(format_version=FORMAT_VERSION + 1),
            [f"$.format_version: {FORMAT_VERSION + 1} is newer"],
        ),
        (
            lambda d: d["shards"][0].update(prefix="../../../etc/passwd"),
            ["$.shards[0].prefix", "leaves the artifact directory"],
        ),
        (lambda d: d["shards"][0].update(prefix="shards/none"), ["$.shards[0].prefix", "names no file"]),
        (
            lambda d: d["tokenizer"].update(
                vocab_size=32002, added_special_tokens={"<|im_start|>": 32000, "<|im_end|>": 32001}
            ),
            [
                "$.data.sources[0]",
                "token ids up to 32001 (2 of them added special tokens)",
                "vocab_size 32000",
            ],
        ),
        (
            lambda d: d["tokenizer"].update(vocab_size="big"),
            ["$.tokenizer.vocab_size: expected int, got str"],
        ),
    ],
)
def test_bad_referenced_artifact(run_dir: Path, edit, fragments: list[str], capsys):
    _patch(run_dir / "tokens" / MANIFEST_NAME, edit)
    p = dry_run(capsys, "--manifest", run_dir / "run.json", "--dry-run", "--world-size", "8")
    assert_one_line_error(p, str(run_dir / "tokens"), *fragments)


def test_dry_run_hashes_only_when_asked(run_dir: Path, capsys):
    """By default referenced files are checked by size (instant on terabytes of shards); a checksum
    that does not match is found with `--verify sha256`."""
    _patch(run_dir / "tokens" / MANIFEST_NAME, lambda d: d["files"][0].update(sha256="0" * 64))
    argv = ["--manifest", run_dir / "run.json", "--dry-run", "--world-size", "8"]
    assert dry_run(capsys, *argv).returncode == 0
    assert_one_line_error(
        dry_run(capsys, *argv, "--verify", "sha256"), str(run_dir / "tokens"), "sha256 differs"
    )
    assert_one_line_error(
        dry_run(capsys, *argv, "--verify", "md5"), "--verify", "'md5' is not one of 'sha256', 'size', 'none'"
    )


def test_bad_manifest_from_the_shell(run_dir: Path):
    """The same convention through the installed console script, as a Makefile would see it."""
    _patch(run_dir / "run.json", lambda d: d["parallel"].update(tp="2"))
    p = run_tool("mega-train", "--manifest", run_dir / "run.json", "--dry-run")
    assert_one_line_error(p, "$.parallel.tp: expected int, got str")
    p = run_tool("mega-train", "--manifest", run_dir / "run.json", "--dry-run", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr


def test_a_signal_a_library_reports_as_its_own_error_still_exits_as_a_stop(monkeypatch, capsys):
    """A signal handler can run inside a library's C code, which then reports the exception it
    raised as one of its own (torch: "ValueError: could not determine the shape of object type
    'torch.storage.UntypedStorage'", seen from mega-export on Ctrl-C): the tool still exits 143
    with its one line, not 1 with the library's message."""
    import os
    import signal

    import typer

    app = typer.Typer()

    @app.command()
    def work() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, as inside the C code
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a call that lets the handler run
        except BaseException as e:  # what the library does with it
            raise ValueError("could not determine the shape of object type 'UntypedStorage'") from e

    monkeypatch.setattr("sys.argv", ["mega-x"])  # a console-script run: the tool owns the signals
    assert run_cli(app, "mega-x") == 143
    assert capsys.readouterr().err == "mega-x: error: terminated\n"


def test_a_torchrun_worker_but_rank_0_is_stopped_quietly(monkeypatch, capsys):
    """When one worker fails, torchrun SIGTERMs the others, maybe while they still check the run:
    rank 0 says why once, the others end with 143 and no line (seen in CI as a second
    "mega-train: error: terminated")."""
    import os
    import signal

    import typer

    app = typer.Typer()

    @app.command()
    def work() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # lets the handler run here

    monkeypatch.setattr("sys.argv", ["mega-x"])
    assert run_cli(app, "mega-x", quiet_stop=True) == 143
    assert capsys.readouterr().err == ""


def test_a_signal_while_a_failure_is_reported_does_not_escape_as_a_traceback(monkeypatch, capsys):
    """Torchrun SIGTERMs every worker as soon as one exits, maybe while another is reporting its
    own failure (CI: rank 1 ending on rank 0's refusal printed `raise Stopped(signum)` and exited
    1): the report ends as it began, with its code and one line."""
    import os
    import signal

    import typer

    from megacore.errors import UserError

    sent = []

    class Refused(UserError):
        def __str__(self) -> str:
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the handler runs here, mid-report
            return "out: in use"

    app = typer.Typer()

    @app.command()
    def work() -> None:
        raise Refused("in use")

    monkeypatch.setattr("sys.argv", ["mega-x"])
    assert run_cli(app, "mega-x") == 2
    assert capsys.readouterr().err == "mega-x: error: out: in use\n"


def test_a_command_quiets_the_libraries_unless_debug(monkeypatch):
    """A console-script run silences the libraries' output that megacore.cli names (their loggers,
    a warning, the switches their bars read) while its command runs, and puts it all back after;
    with --debug or MEGA_DEBUG=1 it silences nothing, and the command knows (`debugging`: what it
    starts gets --debug, as mega-train's workers)."""
    import logging
    import os
    import warnings

    import typer

    from megacore.cli import FOREIGN_LOGGERS, QUIET_VARIABLES, debugging, quieted

    seen = []
    app = typer.Typer()

    @app.command()
    def work() -> None:
        filtered = any(
            f[0] == "ignore" and f[1] and f[1].pattern.startswith("DTensor") for f in warnings.filters
        )
        levels = {logging.getLogger(name).level for name in FOREIGN_LOGGERS}
        seen.append(
            (quieted(), debugging(), filtered, levels, {os.environ.get(n) for n, _ in QUIET_VARIABLES})
        )

    for name, _ in QUIET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    before = {logging.getLogger(name).level for name in FOREIGN_LOGGERS}
    for argv, env in ((["mega-x"], None), (["mega-x", "--debug"], None), (["mega-x"], "1")):
        monkeypatch.setattr("sys.argv", argv)
        if env:
            monkeypatch.setenv("MEGA_DEBUG", env)
        assert run_cli(app, "mega-x") == 0
        assert not quieted() and not debugging()  # as before the command
        assert {logging.getLogger(name).level for name in FOREIGN_LOGGERS} == before
        assert all(os.environ.get(n) is None for n, _ in QUIET_VARIABLES)
    quiet = (True, False, True, {logging.ERROR}, {"1", "ERROR"})
    loud = (False, True, False, before, {None})
    assert seen == [quiet, loud, loud]
