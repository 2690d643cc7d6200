"""Damaged checkpoints never pass silently (issue #20): a file whose size or sha256 differs from
the manifest, or a config its tensors do not fit, is refused by every reader of checkpoint tensors
(mega-shard, mega-export, mega-convert verify) with one line naming the file or tensor, exit 2,
and nothing written. What is read is checked while read (a sum on a helper thread: of each piece
read, or of the whole file for a checkpoint without piece sums) and confirmed before anything made
from it is kept (`confirm`, before a commit or a return). A reader vouches for what it reads: damage
to a piece it does not read is not its to see (`--verify sha256` checks whole files)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import TINY, assert_one_line_error, run_in_process, torchrun_script, write_checkpoint
from mega_export.export import export_hf
from mega_shard.reshard import reshard
from megacore.artifacts import MANIFEST_NAME, TensorReader, check_model_tensors, open_artifact, sha256_file
from megacore.artifacts.pieces import safetensors_layout
from megacore.background import Jobs
from megacore.checkpoint import CheckpointReader, shard_file
from megacore.errors import DamagedFile, UserError
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from megacore.parts import model_tensors

DATA = shard_file(0, 0)


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random checkpoint and its own export, the Hugging Face directory verify compares with."""
    root = tmp_path_factory.mktemp("intact")
    g = torch.Generator().manual_seed(0)
    write_checkpoint(root / "ckpt", {n: torch.randn(s, generator=g) for n, s in model_tensors(TINY).items()})
    export_hf(root / "ckpt", root / "hf", progress=False)
    return root / "ckpt", root / "hf"


def _copy(intact: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(intact[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def truncate(ckpt: Path) -> None:
    data = ckpt / DATA
    data.write_bytes(data.read_bytes()[:-100])


def invert(path: Path, start: int, stop: int) -> None:
    """Bytes [start, stop) of the file inverted in place: same size, other bytes."""
    raw = bytearray(path.read_bytes())
    raw[start:stop] = bytes(b ^ 0xFF for b in raw[start:stop])
    path.write_bytes(bytes(raw))


def overwrite_4k(ckpt: Path, where: float = 0.5) -> None:
    """4 KiB in the file inverted in place (at `where` of its length)."""
    start = int((ckpt / DATA).stat().st_size * where) - 2048
    invert(ckpt / DATA, start, start + 4096)


def damage_tensor(ckpt: Path, key: str, file: str = DATA) -> None:
    """Up to 4 KiB of tensor `key`'s bytes in `file` inverted in place (found through its header)."""
    data_start, header = safetensors_layout(ckpt / file)
    begin, end = header[key]["data_offsets"]
    invert(ckpt / file, data_start + begin, data_start + min(end, begin + 4096))


def tensor_at(ckpt: Path, where: float, file: str = DATA) -> str:
    """The tensor whose bytes hold `where` of the file's length."""
    data_start, header = safetensors_layout(ckpt / file)
    at = int((ckpt / file).stat().st_size * where) - data_start
    return next(
        k
        for k, v in header.items()
        if k != "__metadata__" and v["data_offsets"][0] <= at < v["data_offsets"][1]
    )


def double_heads(ckpt: Path) -> None:
    """The manifest's config hand-edited (num_heads 4 -> 8): the data files still match their sums."""
    doc = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert doc["config"]["num_heads"] == 4 and doc["config"]["head_dim"] == 4
    doc["config"]["num_heads"] = 8
    (ckpt / MANIFEST_NAME).write_text(json.dumps(doc))


TOOLS: dict[str, Callable] = {
    "mega-shard": lambda ckpt, hf, out: run_in_process("mega-shard", ckpt, out, "--tp", "2"),
    "mega-export": lambda ckpt, hf, out: run_in_process("mega-export", ckpt, out),
    "mega-convert verify": lambda ckpt, hf, out: run_in_process(
        "mega-convert", "verify", ckpt, hf, "--seq-len", "8"
    ),
}
CASES = {
    "truncated": (truncate, [f"{DATA}: damaged (size ", "differs from the manifest's"]),
    "4 KiB overwritten": (overwrite_4k, [f"{DATA}: damaged (sha256 of tensor ", "differs from the manifest"]),
    "num_heads 4 -> 8": (
        double_heads,
        ["layers.0.attn.q_proj.weight: shape [16, 16] in the checkpoint, the config implies [32, 16]"],
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", TOOLS)
def test_every_reader_refuses_a_damaged_checkpoint(intact, tmp_path: Path, name: str, case: str):
    ckpt = _copy(intact, tmp_path)
    damage, fragments = CASES[case]
    damage(ckpt)
    p = TOOLS[name](ckpt, intact[1], tmp_path / "out")
    assert_one_line_error(p, str(ckpt), *fragments)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]  # no out, no out.partial


def test_a_damaged_file_is_found_when_read_even_unverified_at_opening(intact, tmp_path: Path):
    """`--verify none` skips the check of every file before starting; the reader still checks each
    file before using it, so the half-written output is removed."""
    ckpt = _copy(intact, tmp_path)
    overwrite_4k(ckpt)
    p = run_in_process("mega-shard", ckpt, tmp_path / "out", "--verify", "none")
    hit = tensor_at(ckpt, 0.5)
    assert_one_line_error(
        p, f"$.files[0]: {DATA}: damaged (sha256 of tensor {hit!r} differs from the manifest)"
    )
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


# --- the library -----------------------------------------------------------------------------------


def test_damage_is_raised_before_anything_read_is_kept(intact, tmp_path: Path):
    """The bytes of the last tensor are damaged and it is read: the read returns (its bytes are
    hashed meanwhile), `confirm` raises DamagedFile naming the file and the tensor, again on every
    call, and so do leaving the `with` block, `decoder()` and `close()`: nothing read outlives the
    reader unconfirmed."""
    ckpt = _copy(intact, tmp_path)
    last = tensor_at(ckpt, 0.97)
    damage_tensor(ckpt, last)
    damaged = rf"{DATA}: damaged \(sha256 of tensor '{last}' differs from the manifest\)"
    with pytest.raises(DamagedFile, match=damaged), CheckpointReader(ckpt) as r:
        assert list(r.read(last).shape) == r.entry(last).shape
        for _ in range(2):
            with pytest.raises(DamagedFile, match=damaged):
                r.confirm()
    with pytest.raises(DamagedFile, match=damaged), CheckpointReader(ckpt) as r:
        r.decoder()
    m = open_artifact(ckpt, "checkpoint", verify="size")
    r = TensorReader(ckpt)
    r.read(last, m.tensors[last])
    with pytest.raises(DamagedFile) as e:
        r.close()
    assert isinstance(e.value, UserError) and "$.files[0]" in str(e.value)
    with pytest.raises(DamagedFile, match="sha256 differs"):
        open_artifact(ckpt, "checkpoint", verify="sha256")


def test_an_error_in_flight_is_the_one_reported(intact, tmp_path: Path):
    """Leaving the `with` block by another error stops the sums instead of confirming them: that
    error is reported, not masked by the damage it may have nothing to do with."""
    ckpt = _copy(intact, tmp_path)
    overwrite_4k(ckpt)
    with pytest.raises(KeyError, match="elsewhere"), CheckpointReader(ckpt) as r:
        r.read("norm.weight")
        raise KeyError("elsewhere")


def test_a_stopped_sum_passes_for_no_file(intact):
    """A sum stopped half-way (a reader given up) returns "", which matches no manifest."""
    data, entry = intact[0] / DATA, open_artifact(intact[0], "checkpoint").files[0]
    assert sha256_file(data) == entry.sha256
    stop = threading.Event()
    stop.set()
    assert sha256_file(data, stop) == ""


def test_bytes_that_do_not_read_are_reported_as_the_damage_they_are(intact, tmp_path: Path):
    """A header overwritten in place (same size, unchecked at opening with `verify="none"`) fails to
    parse before its sum is done: the reader confirms first and reports the damage."""
    ckpt = _copy(intact, tmp_path)
    raw = bytearray((ckpt / DATA).read_bytes())
    raw[8:40] = bytes(b ^ 0xFF for b in raw[8:40])
    (ckpt / DATA).write_bytes(bytes(raw))
    with pytest.raises(DamagedFile, match=rf"{DATA}: damaged \(sha256"):
        CheckpointReader(ckpt, verify="none").read("norm.weight")


def test_the_first_damaged_file_of_those_read_is_named(intact, tmp_path: Path):
    """Two files (tp 2): a piece is hashed once it is read, so damage to one not read goes unseen;
    with both read and both damaged, `confirm` names the first in `$.files`."""
    ckpt = tmp_path / "tp2"
    reshard(intact[0], ckpt, tp=2, pp=1, log=lambda msg: None, progress=False)
    files = [e.path for e in open_artifact(ckpt, "checkpoint").files if e.path.endswith(".safetensors")]
    assert files == [shard_file(0, 0), shard_file(0, 1)]
    name = "layers.0.mlp.down_proj.weight"  # split over tp: a piece in each file
    rank0_only = ((0, 0), (16, 16))
    damage_tensor(ckpt, name, files[1])
    with CheckpointReader(ckpt) as r:
        r.read(name, rank0_only)
    with (
        pytest.raises(DamagedFile, match=rf"\$.files\[1\]: {files[1]}: damaged"),
        CheckpointReader(ckpt) as r,
    ):
        r.read(name)
    damage_tensor(ckpt, name, files[0])
    with (
        pytest.raises(DamagedFile, match=rf"\$.files\[0\]: {files[0]}: damaged"),
        CheckpointReader(ckpt) as r,
    ):
        r.read(name)


def test_a_training_load_raises_damage_before_it_returns(intact, tmp_path: Path, monkeypatch):
    """`load_checkpoint` (a run resuming) copies the slices while their file is hashed, and raises
    DamagedFile before it returns, which is what sends a run back to an older checkpoint."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a one-process group of its own
        monkeypatch.delenv(var, raising=False)
    ckpt = _copy(intact, tmp_path)
    try:
        pm = ParallelModel(TINY, Parallelism(precision="fp32"), build_mesh(), "cpu")
        load_checkpoint(ckpt, pm)
        with CheckpointReader(ckpt) as r:
            assert torch.equal(dict(pm.named_parameters())["norm.weight"], r.read("norm.weight"))
        overwrite_4k(ckpt, where=0.97)
        with pytest.raises(DamagedFile, match=rf"{DATA}: damaged \(sha256"):
            load_checkpoint(ckpt, pm)
    finally:
        shutdown()


def test_a_missing_or_cut_file_is_damaged_too(intact, tmp_path: Path):
    ckpt = _copy(intact, tmp_path)
    truncate(ckpt)
    with pytest.raises(DamagedFile, match=r"damaged \(size"):
        CheckpointReader(ckpt)
    (ckpt / DATA).unlink()
    with pytest.raises(DamagedFile, match=r"damaged \(listed in the manifest but missing\)"):
        CheckpointReader(ckpt, verify="none").read("norm.weight")


def test_each_file_is_hashed_once_per_reader(intact, tmp_path: Path):
    """Once confirmed (hashed by `open_artifact(..., verify="sha256")`, or while first read), a piece
    is not hashed again by the same reader, `release` included: damage made afterwards goes unseen
    by it, and is seen by a new reader."""
    ckpt = _copy(intact, tmp_path)
    with CheckpointReader(ckpt) as r:
        r.read("norm.weight")
        r.release()
        r.confirm()
        damage_tensor(ckpt, "norm.weight")
        r.read("norm.weight")
    with pytest.raises(DamagedFile, match="'norm.weight'"), CheckpointReader(ckpt, verify="size") as r:
        r.read("norm.weight")
    shutil.rmtree(ckpt)
    ckpt = _copy(intact, tmp_path)
    with CheckpointReader(ckpt, verify="sha256") as r:
        damage_tensor(ckpt, "norm.weight")
        r.read("norm.weight")


def test_tensors_are_checked_against_the_config(intact, tmp_path: Path):
    m = open_artifact(intact[0], "checkpoint")
    check_model_tensors(m, "here")
    del m.tensors["layers.1.mlp.down_proj.weight"]
    with pytest.raises(UserError) as e:
        check_model_tensors(m, "here")
    assert (
        str(e.value)
        == "here: layers.1.mlp.down_proj.weight: missing from the checkpoint, the config implies [16, 32]"
    )
    ckpt = _copy(intact, tmp_path)
    double_heads(ckpt)
    with pytest.raises(UserError, match=r"q_proj.weight: shape \[16, 16\] in the checkpoint") as e:
        CheckpointReader(ckpt)
    assert not isinstance(e.value, DamagedFile)  # the files are intact: not a reason to fall back


# --- per-piece sums ---------------------------------------------------------------------------------


def moment(name: str) -> str:
    return f"optim.exp_avg.{name}"


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Path:
    """A training checkpoint in one file: fp32 weights and an AdamW moment of each."""
    root = tmp_path_factory.mktemp("training")
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(s, generator=g) for n, s in model_tensors(TINY).items()}
    write_checkpoint(
        root / "ckpt", {**weights, **{moment(n): torch.randn_like(t) for n, t in weights.items()}}
    )
    return root / "ckpt"


def test_a_reader_vouches_for_the_pieces_it_reads_and_no_others(training, tmp_path: Path):
    """Export reads the weights alone, and hashes only their bytes: a moment damaged in place is
    not seen by it (deliberately: `--verify sha256` checks whole files, and a training load, which
    reads the moments, sees it), while a weight damaged in place is DamagedFile naming the tensor."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(training, ckpt)
    damage_tensor(ckpt, moment("norm.weight"))
    export_hf(ckpt, tmp_path / "hf", progress=False)
    assert (tmp_path / "hf" / MANIFEST_NAME).is_file()
    with pytest.raises(DamagedFile, match=r"sha256 differs from the manifest"):
        open_artifact(ckpt, "checkpoint", verify="sha256")
    damaged = rf"sha256 of tensor '{moment('norm.weight')}' differs"
    with pytest.raises(DamagedFile, match=damaged), CheckpointReader(ckpt) as r:
        r.read(moment("norm.weight"))
    damage_tensor(ckpt, "layers.1.attn.v_proj.weight")
    with pytest.raises(
        DamagedFile, match=rf"{DATA}: damaged \(sha256 of tensor 'layers.1.attn.v_proj.weight'"
    ):
        export_hf(ckpt, tmp_path / "hf2", progress=False)
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "hf2.partial").exists()


def test_old_checkpoints_without_piece_sums_are_hashed_whole(training, tmp_path: Path):
    """A manifest written before piece sums (no `sha256` in its pieces) still decodes, and its
    readers hash whole files: damage to a moment is found by a reader of one weight."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(training, ckpt)
    doc = json.loads((ckpt / MANIFEST_NAME).read_text())
    for entry in doc["tensors"].values():
        for piece in entry["pieces"]:
            del piece["sha256"]
    (ckpt / MANIFEST_NAME).write_text(json.dumps(doc))
    assert all(p.sha256 is None for e in open_artifact(ckpt, "checkpoint").tensors.values() for p in e.pieces)
    damage_tensor(ckpt, moment("norm.weight"))
    whole_file = rf"{DATA}: damaged \(sha256 differs from the manifest\)"
    with pytest.raises(DamagedFile, match=whole_file), CheckpointReader(ckpt) as r:
        r.read("norm.weight")


def test_a_header_entry_unlike_the_manifest_is_damage(intact, tmp_path: Path):
    """A piece's sum covers its data, not the header entry that locates and types it: that entry is
    checked against the manifest, and one edited in place (dtype F32 -> I32, the same bytes, no
    check at opening) sends the file to be hashed whole, which finds the damage."""
    ckpt = _copy(intact, tmp_path)
    raw = (ckpt / DATA).read_bytes()
    at = raw.index(b'"norm.weight":{"dtype":"F32"')
    (ckpt / DATA).write_bytes(raw[:at] + raw[at:].replace(b'"F32"', b'"I32"', 1))
    with pytest.raises(DamagedFile, match=rf"{DATA}: damaged \(sha256 differs from the manifest\)"):
        CheckpointReader(ckpt, verify="none").read("norm.weight")


@pytest.mark.dist
def test_a_two_process_training_save_records_every_piece_sum(tmp_path: Path):
    """`save_checkpoint` in 2 processes (tp 2, AdamW moments; rank 0 merges rank 1's records): every
    piece's sha256 is that of its tensor's bytes as the `safetensors` library reads them."""
    torchrun_script(2, Path(__file__).with_name("save_worker.py"), tmp_path / "ckpt", timeout=600)
    m = open_artifact(tmp_path / "ckpt", "checkpoint")
    pieces = [p for e in m.tensors.values() for p in e.pieces]
    assert {p.file for p in pieces} == {shard_file(0, 0), shard_file(0, 1)}
    assert moment("layers.0.attn.q_proj.weight") in m.tensors
    for p in pieces:
        with safe_open(str(tmp_path / "ckpt" / p.file), framework="numpy") as f:
            assert p.sha256 == hashlib.sha256(f.get_tensor(p.key).tobytes()).hexdigest(), (p.file, p.key)


def test_the_sums_of_one_file_run_one_at_a_time_in_order():
    """A reader's piece sums of one file share a `Jobs` lane: one sequential pass at a time, in the
    order read (as the whole file's sum was), while another file's lane runs beside it."""
    jobs = Jobs(2)
    running: list[str] = []
    log: list[str] = []
    other_ran = threading.Event()

    def piece(name: str) -> str:
        running.append(name)
        assert running == [name], running  # never two calls of lane "a" at once
        if name == "a0":  # waits for lane "b": it runs on the other thread meanwhile
            assert other_ran.wait(10)
        log.append(name)
        running.remove(name)
        return name

    def other() -> str:
        other_ran.set()
        return "b"

    futures = [jobs.submit(piece, f"a{i}", lane="a") for i in range(4)]
    assert jobs.submit(other, lane="b").result(10) == "b"
    assert [f.result(10) for f in futures] == ["a0", "a1", "a2", "a3"] == log
    jobs.cancel()
