"""Shared test helpers (importable from any test as `helpers`): running the installed console
scripts as a user would, the one-line-error assertion, a tiny checkpoint writer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacore.artifacts import (
    CheckpointManifest,
    ModelConfig,
    Piece,
    SafetensorsStreamWriter,
    new_header_fields,
    piece_entry,
    write_artifact,
)

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


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> None:
    """The bad-input convention: exit code, one line on stderr naming what and where, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


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
    out: Path, tensors: dict[str, torch.Tensor], *, force: bool = False
) -> CheckpointManifest:
    """One safetensors file, one piece per tensor (the tp1/pp1 layout)."""
    with write_artifact(out, force=force) as w:
        specs = [(name, "float32", list(t.shape)) for name, t in tensors.items()]
        with SafetensorsStreamWriter(w.path("model.safetensors"), specs) as sw:
            for name, t in tensors.items():
                sw.write(name, t)
        w.record("model.safetensors", sw.close())
        entries = {
            name: piece_entry(
                t.shape,
                "float32",
                [Piece(file="model.safetensors", key=name, offset=[0] * t.ndim, shape=list(t.shape))],
            )
            for name, t in tensors.items()
        }
        manifest = CheckpointManifest(
            **new_header_fields("tests", "0"), config=TINY, dtype="float32", tensors=entries
        )
        return w.commit(manifest)
