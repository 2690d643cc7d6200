"""Bad input through every tool's real command line: one line, exit 2, nothing half-written, and
help texts that tell the truth (choices, usage, examples, defaults, progress, plurals)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import BIN, TINY, assert_one_line_error, run_tool, write_checkpoint
from hf_cases import build
from megacore.artifacts import MANIFEST_NAME, open_artifact
from megacore.config import ModelConfig
from megacore.parts import model_tensors
from tokenize_testlib import corpus, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    out = tmp_path_factory.mktemp("ck") / "ckpt"
    write_checkpoint(out, {n: torch.randn(s, generator=g) for n, s in model_tensors(TINY).items()})
    return out


# --- choices, usage lines, examples, defaults ----------------------------------------------------

CHOICES = [
    ("mega-tokenize", [], "--engine", ["auto", "sentencepiece", "hf", "gigatoken"]),
    ("mega-tokenize", [], "--format", ["text", "chat", "preference", "prompts"]),
    ("mega-tokenize", [], "--on-error", ["fail", "skip"]),
    ("mega-tokenize", [], "--chat-template", ["chatml", "tokenizer"]),
    ("mega-convert", ["hf"], "--dtype", ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]),
    ("mega-convert", ["verify"], "--dtype", ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]),
    ("mega-export", [], "--dtype", ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]),
    ("mega-shard", [], "--verify", ["sha256", "size", "none"]),
    ("mega-train", [], "--verify", ["sha256", "size", "none"]),
]
POSITIONAL = {"mega-tokenize": ["c.jsonl", "OUT", "-t", "x.model"], "mega-convert": ["IN", "OUT"]}


@pytest.mark.parametrize(("tool", "sub", "option", "choices"), CHOICES)
def test_choice_options_list_their_choices_and_refuse_others(tool, sub, option, choices, tmp_path: Path):
    help_text = run_tool(tool, *sub, "--help").stdout
    assert f"<{'|'.join(choices)}>" in re.sub(r"\s+", " ", help_text), help_text
    args = [*sub, *POSITIONAL.get(tool, ["IN", "OUT"] if tool != "mega-train" else ["-m", "run.json"])]
    p = run_tool(tool, *args, option, "float8", cwd=tmp_path)
    assert_one_line_error(p, option, "'float8' is not one of", *(f"'{c}'" for c in choices))
    assert list(tmp_path.iterdir()) == []  # nothing created, no .partial


@pytest.mark.parametrize(
    ("tool", "usage"),
    [
        ("mega-tokenize", "Usage: mega-tokenize [OPTIONS] INPUTS... OUT"),
        ("mega-shard", "Usage: mega-shard [OPTIONS] CHECKPOINT OUT"),
        ("mega-export", "Usage: mega-export [OPTIONS] CHECKPOINT OUT"),
        ("mega-convert hf", "Usage: mega-convert hf [OPTIONS] MODEL_DIR OUT"),
        ("mega-convert verify", "Usage: mega-convert verify [OPTIONS] CHECKPOINT MODEL_DIR"),
    ],
)
def test_usage_lines_name_the_arguments_in_capitals(tool: str, usage: str):
    assert run_tool(*tool.split(), "--help").stdout.splitlines()[0] == usage


@pytest.mark.parametrize("tool", ["mega-tokenize", "mega-convert", "mega-shard", "mega-train", "mega-export"])
def test_help_examples_name_files_that_exist(tool: str):
    text = run_tool(tool, "--help").stdout
    for path in re.findall(r"\bexamples/[\w./-]+", text):
        assert (REPO / path).exists(), f"{tool} --help names {path}, which does not exist"


def test_world_size_default_is_told_not_shown_as_zero():
    text = re.sub(r"\s+", " ", run_tool("mega-train", "--help").stdout)
    assert "$WORLD_SIZE" in text and "[default: 0]" not in text


# --- --debug anywhere, MEGA_DEBUG ----------------------------------------------------------------

BAD_CALLS = {
    "mega-tokenize": ["nothing.jsonl", "out", "-t", "nothing.model"],
    "mega-convert": ["hf", "nothing", "out"],
    "mega-shard": ["nothing", "out"],
    "mega-train": ["--manifest", "nothing.json", "--dry-run"],
    "mega-export": ["nothing", "out"],
}


# The tools that load torch and transformers to fail take 8 s each: make test-slow runs them.
@pytest.mark.parametrize(
    "tool",
    [
        t if t in ("mega-tokenize", "mega-train") else pytest.param(t, marks=pytest.mark.slow)
        for t in sorted(BAD_CALLS)
    ],
)
def test_debug_works_in_any_position_and_from_the_environment(tool: str, tmp_path: Path):
    args = BAD_CALLS[tool]
    plain = run_tool(tool, *args, cwd=tmp_path)
    assert_one_line_error(plain, "nothing")
    for argv, env in (([*args, "--debug"], {}), (["--debug", *args], {}), (args, {"MEGA_DEBUG": "1"})):
        p = run_tool(tool, *argv, cwd=tmp_path, env=env)
        assert p.returncode == 2 and "Traceback" in p.stderr, (argv, env, p.stderr)
        assert p.stderr.strip().splitlines()[-1] == plain.stderr.strip()


# --- bad input that used to escape as a Python exception ------------------------------------------


def test_a_piece_whose_key_is_not_in_its_file_is_one_line(ckpt: Path, tmp_path: Path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    doc = json.loads((bad / MANIFEST_NAME).read_text())
    doc["tensors"]["norm.weight"]["pieces"][0]["key"] = "no.such.key"
    (bad / MANIFEST_NAME).write_text(json.dumps(doc))
    for tool, args in (
        ("mega-shard", [bad, tmp_path / "o1", "--tp", "2"]),
        ("mega-export", [bad, tmp_path / "o2"]),
    ):
        p = run_tool(tool, *args)
        assert_one_line_error(
            p, '$.tensors["norm.weight"]', "'no.such.key' is not a tensor of model-pp00-tp00.safetensors"
        )
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad"]


def test_verify_against_a_model_of_another_shape_is_one_line(tmp_path: Path):
    a = build("llama", tmp_path / "a")
    b = build("llama", tmp_path / "b", intermediate_size=80)
    assert run_tool("mega-convert", "hf", a, tmp_path / "ckpt").returncode == 0
    p = run_tool("mega-convert", "verify", tmp_path / "ckpt", b)
    assert_one_line_error(p, "differs from", "ffn_hidden_size")


def test_verify_output_is_ours_only(tmp_path: Path):
    """transformers' progress bars and load reports do not leak into the tool's output."""
    hf = build("mistral-window", tmp_path / "hf")
    run_tool("mega-convert", "hf", hf, tmp_path / "ckpt", check=True)
    p = run_tool("mega-convert", "verify", tmp_path / "ckpt", hf, "--seq-len", "16", check=True)
    assert p.stderr == "" and len(p.stdout.strip().splitlines()) == 1 and "PASS" in p.stdout


# --- failures and interrupts clean up the same way ------------------------------------------------


def test_a_failure_while_writing_leaves_nothing(ckpt: Path, tmp_path: Path):
    """A checkpoint whose data file was cut short (manifest sizes made to match): every reading tool
    fails after it started writing, exits 2 with one line, and leaves neither OUT nor OUT.partial."""
    import shutil

    bad = tmp_path / "cut"
    shutil.copytree(ckpt, bad)
    data = bad / "model-pp00-tp00.safetensors"
    data.write_bytes(data.read_bytes()[:-64])
    doc = json.loads((bad / MANIFEST_NAME).read_text())
    doc["files"][0]["size"] = data.stat().st_size
    (bad / MANIFEST_NAME).write_text(json.dumps(doc))
    for tool, out in (("mega-shard", "s"), ("mega-export", "e")):
        p = run_tool(tool, bad, tmp_path / out)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not (tmp_path / out).exists() and not (tmp_path / f"{out}.partial").exists()


# Wide enough (70 MB of float32 weights) that converting, sharding or exporting it is caught mid-write.
WIDE = ModelConfig(
    family="llama",
    vocab_size=4096,
    hidden_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=1536,
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, Path]:
    """The WIDE model as a Hugging Face directory (transformers' own) and as a checkpoint."""
    root = tmp_path_factory.mktemp("wide")
    hf = build(
        "llama",
        root / "hf",
        hidden_size=WIDE.hidden_size,
        num_hidden_layers=WIDE.num_layers,
        num_attention_heads=WIDE.num_heads,
        num_key_value_heads=WIDE.num_kv_heads,
        intermediate_size=WIDE.ffn_hidden_size,
        vocab_size=WIDE.vocab_size,
    )
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) for n, s in model_tensors(WIDE).items()}
    write_checkpoint(root / "ckpt", tensors, config=WIDE)
    return {"hf": hf, "ckpt": root / "ckpt"}


def _busy_call(tool: str, out: Path, request) -> tuple[list, Path]:
    """Arguments that keep `tool` writing for a while, and a file of OUT.partial that exists once it
    writes."""
    partial = out.with_name(out.name + ".partial")
    if tool == "mega-tokenize":
        src = write_jsonl(out.with_name("big.jsonl"), [{"text": d} for d in corpus(300)] * 150)
        sp = request.getfixturevalue("sp_model")
        return [src, out, "-t", sp, "--engine", "sentencepiece"], partial / "shards"
    wide = request.getfixturevalue("wide")
    if tool == "mega-convert":
        return ["hf", wide["hf"], out], partial / "model-pp00-tp00.safetensors"
    if tool == "mega-shard":
        return [wide["ckpt"], out, "--tp", "2"], partial / "model-pp00-tp00.safetensors"
    return [wide["ckpt"], out], partial / "model.safetensors"


@pytest.mark.parametrize(
    ("sig", "code", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
@pytest.mark.parametrize("tool", ["mega-tokenize", "mega-convert", "mega-shard", "mega-export"])
def test_ctrl_c_and_sigterm_leave_nothing(tool: str, sig, code: int, word: str, tmp_path: Path, request):
    """Stopped while it writes OUT.partial, a tool exits 128 + the signal with one line and leaves
    neither OUT nor OUT.partial. (mega-train saves and stops on SIGTERM: tests/train.)"""
    out = tmp_path / "out"
    args, writing = _busy_call(tool, out, request)
    proc = subprocess.Popen(
        [str(BIN / tool), *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 60
    while not writing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted: make its input larger"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.strip() == f"{tool}: error: {word}", (proc.returncode, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["big.jsonl"] if tool == "mega-tokenize" else [])


# --- what the tools print --------------------------------------------------------------------------


def _on_a_terminal(*argv: object) -> str:
    """Run a command with its stderr on a pseudo-terminal; returns what it wrote there."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(a) for a in argv], stderr=follower, stdout=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    assert proc.returncode == 0
    return b"".join(chunks).decode()


def test_convert_and_export_show_progress_on_a_terminal_only(tmp_path: Path):
    hf = build("llama", tmp_path / "hf")
    shown = _on_a_terminal(BIN / "mega-convert", "hf", hf, tmp_path / "ckpt")
    assert re.search(r"mega-convert: \d+/\d+ tensors .*GB", shown), shown
    shown = _on_a_terminal(BIN / "mega-export", tmp_path / "ckpt", tmp_path / "hf2")
    assert re.search(r"mega-export: \d+/\d+ tensors .*GB", shown), shown
    piped = run_tool("mega-export", tmp_path / "ckpt", tmp_path / "hf3", check=True)
    assert "tensors (" not in piped.stderr and "\r" not in piped.stderr


def test_counts_are_singular_when_one(ckpt: Path, tmp_path: Path):
    p = run_tool("mega-export", ckpt, tmp_path / "hf", check=True)
    assert " in 1 file," in p.stdout, p.stdout


def test_a_sentencepiece_model_is_stored_as_tokenizer_model(tmp_path: Path, sp_model: Path):
    assert sp_model.name != "tokenizer.model"
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in corpus(5)])
    run_tool("mega-tokenize", src, tmp_path / "tok", "-t", sp_model, check=True)
    m = open_artifact(tmp_path / "tok", "tokens")
    assert m.tokenizer.files == ["tokenizer/tokenizer.model"]
    assert (tmp_path / "tok" / "tokenizer" / "tokenizer.model").read_bytes() == sp_model.read_bytes()


def test_dry_run_json_paths_are_all_resolved_the_same_way(tmp_path: Path, sp_model: Path):
    """`init` and the data paths of the plan are both the manifest's refs resolved against its
    directory, printed as paths that work from where the command ran."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in corpus(5)])
    run_tool("mega-tokenize", src, tmp_path / "data" / "tok", "-t", sp_model, check=True)
    cfg = ModelConfig(
        family="llama",
        vocab_size=512,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=32,
    )
    write_checkpoint(
        tmp_path / "models" / "ckpt", {n: torch.zeros(s) for n, s in model_tensors(cfg).items()}, config=cfg
    )
    (tmp_path / "runs").mkdir()
    run = {
        "kind": "run",
        "format_version": 1,
        "out": "run-out",
        "model": {"init": "../models/ckpt"},
        "data": {"sources": [{"path": "../data/tok"}]},
        "batch": {"micro_batch_size": 1, "global_batch_size": 2, "seq_length": 16},
        "train_steps": 1,
    }
    (tmp_path / "runs" / "run.json").write_text(json.dumps(run))
    p = run_tool("mega-train", "--manifest", "runs/run.json", "--dry-run", "--json", cwd=tmp_path, check=True)
    plan = json.loads(p.stdout)
    assert (tmp_path / plan["init"]).resolve() == (tmp_path / "models" / "ckpt").resolve()
    assert (tmp_path / plan["data"][0]["path"]).resolve() == (tmp_path / "data" / "tok").resolve()
    assert (tmp_path / plan["out"]).resolve() == (tmp_path / "runs" / "run-out").resolve()
    assert not (tmp_path / "runs" / "run-out").exists()  # a dry run writes nothing
    p = run_tool(
        "mega-train",
        "--manifest",
        "runs/run.json",
        "--dry-run",
        "--world-size",
        "2",
        cwd=tmp_path,
        check=True,
    )
    assert "; 1 data source" in p.stdout, p.stdout
