"""Atomic writing, path confinement and checksum verification of artifacts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import write_checkpoint
from megacore.artifacts import MANIFEST_NAME, TensorReader, open_artifact, parent_of, write_artifact
from megacore.errors import UserError


def _edit_manifest(root: Path, fn) -> None:
    path = root / MANIFEST_NAME
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_written_artifact_verifies_and_reads_back(checkpoint: Path):
    m = open_artifact(checkpoint, "checkpoint")
    assert [f.path for f in m.files] == ["model-pp00-tp00.safetensors"]
    assert not checkpoint.with_name("ckpt.partial").exists()
    with TensorReader(checkpoint) as r:
        assert torch.equal(r.read("norm.weight", m.tensors["norm.weight"]), torch.ones(16))


def test_existing_artifact_needs_force(checkpoint: Path):
    with pytest.raises(UserError, match="already exists; pass --force"):
        write_checkpoint(checkpoint, {"x": torch.zeros(2)})
    write_checkpoint(checkpoint, {"x": torch.zeros(2)}, force=True)
    assert list(open_artifact(checkpoint, "checkpoint").tensors) == ["x"]


def test_refuses_to_overwrite_a_directory_that_is_not_an_artifact(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="is not an artifact"):
        write_checkpoint(tmp_path / "data", {"x": torch.zeros(2)}, force=True)
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_failure_inside_the_writer_leaves_nothing(tmp_path: Path):
    with pytest.raises(RuntimeError), write_artifact(tmp_path / "out", "checkpoint") as w:
        w.path("a.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.partial").exists()


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from megacore.artifacts import write_artifact
    with write_artifact(Path(sys.argv[1]), "checkpoint", force=True) as w:
        with open(w.path("model.safetensors"), "wb") as f:
            f.write(b"new data" * 1000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """
)


def test_killed_writer_leaves_old_artifact_untouched(checkpoint: Path):
    before = (checkpoint / MANIFEST_NAME).read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(checkpoint)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    partial = checkpoint.with_name("ckpt.partial")
    assert partial.is_dir() and not (partial / MANIFEST_NAME).exists()
    assert (checkpoint / MANIFEST_NAME).read_bytes() == before
    open_artifact(checkpoint, "checkpoint")  # still verifies
    with pytest.raises(UserError, match="incomplete artifact: no manifest.json"):
        open_artifact(partial)
    # The next run cleans the leftover and completes.
    write_checkpoint(checkpoint, {"y": torch.ones(3)}, force=True)
    assert not partial.exists()
    assert list(open_artifact(checkpoint, "checkpoint").tensors) == ["y"]


def test_missing_manifest_is_incomplete(tmp_path: Path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="incomplete artifact"):
        open_artifact(tmp_path / "half")
    with pytest.raises(UserError, match="no such artifact directory"):
        open_artifact(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("bad_path", "message"),
    [
        ("/etc/passwd", "is absolute"),
        ("../ckpt2/model-pp00-tp00.safetensors", "leaves the artifact directory"),
        ("sub/../../x", "leaves the artifact directory"),
    ],
)
def test_file_paths_are_confined(checkpoint: Path, bad_path: str, message: str):
    _edit_manifest(checkpoint, lambda d: d["files"][0].update(path=bad_path))
    with pytest.raises(UserError, match=message) as e:
        open_artifact(checkpoint)
    assert "$.files[0]" in str(e.value)


def test_symlink_out_of_the_artifact_is_refused(checkpoint: Path, tmp_path: Path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    (checkpoint / "link.bin").symlink_to(outside)
    _edit_manifest(
        checkpoint, lambda d: d["files"].append({"path": "link.bin", "size": 6, "sha256": "0" * 64})
    )
    with pytest.raises(UserError, match="resolves outside the artifact"):
        open_artifact(checkpoint)


def test_wrong_checksum_and_size(checkpoint: Path):
    data = checkpoint / "model-pp00-tp00.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"model-pp00-tp00.safetensors: damaged \(sha256 differs"):
        open_artifact(checkpoint)
    open_artifact(checkpoint, verify="size")  # same size: the cheap check passes
    data.write_bytes(bytes(raw) + b"x")
    with pytest.raises(UserError, match="size .* differs"):
        open_artifact(checkpoint, verify="size")
    data.unlink()
    with pytest.raises(UserError, match="missing"):
        open_artifact(checkpoint, verify="size")


def test_parent_records_manifest_hash(checkpoint: Path):
    p = parent_of(checkpoint)
    assert p.kind == "checkpoint" and len(p.manifest_sha256) == 64 and p.path == str(checkpoint)
