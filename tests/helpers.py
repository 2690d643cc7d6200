"""Shared test helpers (importable from any test as `helpers`): running the installed console
scripts as a user would, the one-line-error assertion, a tiny checkpoint writer."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacore.artifacts import CheckpointManifest, whole, write_artifact
from megacore.artifacts.manifest import Layout
from megacore.checkpoint import CheckpointWriter, shard_file
from megacore.config import ModelConfig

BIN = Path(sys.executable).parent
SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MISTRAL_TOKENIZER = SHARED / "assets" / "mistral-v1-tokenizer.model"


def run_tool(tool: str, *args: str | os.PathLike, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run `tool` (a console script from this venv) and capture its output as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    proc = subprocess.run(
        [str(BIN / tool), *map(str, args)], capture_output=True, text=True, env=env, timeout=600, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_in_process(tool: str, *args: str | os.PathLike, check: bool = False) -> subprocess.CompletedProcess:
    """`tool`'s command line run in this process, through the same `megacore.cli.run` its console
    script calls (exit code, one-line errors), its output captured: a tool's start costs seconds
    (torch, transformers), so tests that call a tool many times call it here."""
    from megacore.cli import run

    app = importlib.import_module(tool.replace("-", "_") + ".cli").app
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(app, tool, [str(a) for a in args])
    proc = subprocess.CompletedProcess([tool, *map(str, args)], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{tool} exited {code}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def dry_run_without_torch(*argv: str | os.PathLike) -> subprocess.CompletedProcess:
    """`mega-train *argv` (a dry run) through its CLI in a fresh interpreter, which fails unless the
    command exits 0 without importing torch."""
    args = [str(a) for a in argv]
    code = (
        "import sys; from megacore.cli import run; from mega_train.cli import app; "
        f"c = run(app, 'mega-train', {args!r}); "
        "assert c == 0, c; assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def torchrun_script(
    nproc: int, script: Path, *args: str | os.PathLike, env: dict | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """A test worker script under torchrun (standalone, gloo, OMP_NUM_THREADS=1, tests/ on the
    path); asserts it exited 0, showing the ends of its output if not."""
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(script), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> None:
    """The bad-input convention: exit code, one line on stderr naming what and where, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# Our lines on stderr: a tool's own message (`mega-train: ...`, the harness's `lm-eval (mega): ...`),
# and mega-train's console where `--json` sends it (the plan's `run.json: ok — ...`, `step ...`).
OUR_LINE = re.compile(
    r"(mega-(tokenize|convert|shard|train|export)|lm-eval \(mega\)): |\S+: ok — |step \d+[ /]"
)


def assert_quiet(stderr: str) -> None:
    """The quiet console: stderr holds only our lines (OUR_LINE), no library's warning, log line or
    progress bar (a bar redraws after carriage returns: each piece counts as a line)."""
    foreign = [line for line in re.split(r"[\r\n]", stderr) if line.strip() and not OUR_LINE.match(line)]
    assert not foreign, "not our lines on stderr:\n" + "\n".join(foreign[:30])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: object = "") -> None:
    """Same dtype, shape and bytes (torch.equal would take -0.0 for 0.0 and miss a NaN payload)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    ), what


def mistral_tokenizer() -> Path:
    """The real 32k tokenizer in ../shared/assets, or skip where ../shared is absent."""
    if not MISTRAL_TOKENIZER.is_file():
        pytest.skip("../shared/assets/mistral-v1-tokenizer.model is not present")
    return MISTRAL_TOKENIZER


TINY = ModelConfig(
    family="llama",
    vocab_size=64,
    hidden_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=32,
)


def write_checkpoint(
    out: Path,
    tensors: dict[str, torch.Tensor],
    *,
    force: bool = False,
    config: ModelConfig = TINY,
    side_files: dict[str, bytes] | None = None,
    **commit,
) -> CheckpointManifest:
    """One safetensors file, one piece per tensor (the tp1/pp1 layout), through the checkpoint
    writer; `side_files` (relative path -> bytes) are written beside it, e.g. tokenizer files."""
    with write_artifact(out, "checkpoint", force=force) as w:
        for rel, data in (side_files or {}).items():
            w.path(rel).write_bytes(data)
        cw = CheckpointWriter(w)
        cw.write_file(shard_file(0, 0), [(n, t.shape, whole(t.shape), t) for n, t in tensors.items()])
        layout = Layout(stage_layers=[list(range(config.num_layers))])
        dtype = next(iter(cw.records()[1].values()))[1]
        return cw.commit(config=config, dtype=dtype, layout=layout, producer=("tests", "0"), **commit)


def load_decoder(path: Path, dtype: torch.dtype | None = None):
    """A whole Decoder with a checkpoint's weights (any layout; one process)."""
    from megacore.checkpoint import CheckpointReader

    with CheckpointReader(path) as ckpt:
        return ckpt.decoder(dtype)
