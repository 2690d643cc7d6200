"""Saving and loading a live (parallel) model's state as a checkpoint artifact.

Save: every rank writes one file (`shard_file`) with the pieces it owns (its shard of each parameter
and of its AdamW moments, `optim.<kind>.<param>`); a piece replicated over some mesh dims is written
by the rank at coordinate 0 of those dims only, so the pieces tile every tensor exactly once. Rank 0
applies the output policy, gathers the others' records and commits the one manifest
(`megacore.checkpoint.CheckpointWriter`) once every rank's files are written; when any rank could not
write (a full disk, a permission), it removes the staging directory instead and every rank raises
`SaveFailed`. Per-rank state that is no tensor of the model (RNG states) goes into
`rank-state/rank-NNNNN.safetensors`, listed in `training.rng_files`. A save is two halves: `snapshot`
(collective, quick: the staging directory, and this rank's pieces copied to host buffers) and
`write_snapshot` (collective over a group of its own, so a background thread can run it while
training goes on: mega_train's asynchronous checkpoints); `save_checkpoint` runs both at once.

Load: every rank reads only the slices its parameters (and moments) need, from whatever layout the
checkpoint has (`megacore.checkpoint.CheckpointReader`), so a run resumes with other tp/pp/dp sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, Replicate

from megacore.artifacts import ArtifactWriter, CheckpointManifest, prepare_output
from megacore.artifacts.header import Parent
from megacore.artifacts.manifest import Adapter, Layout, License, TrainedTokenizer, TrainingState
from megacore.artifacts.pieces import Box
from megacore.artifacts.reader import check_file
from megacore.checkpoint import CheckpointReader, CheckpointWriter, dtype_of, shard_file
from megacore.config import TOKEN_ID_FIELDS, config_differences
from megacore.errors import UserError
from megacore.models.nf4 import fill, is_nf4
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import ADAMW_STATE_KINDS, optim_state_name
from megacore.parallel.mesh import dp_mesh
from megacore.parallel.pieces import local_piece


def _owner(t: torch.Tensor, mesh) -> bool:
    """Whether this rank writes its piece of `t`: coordinate 0 on every dim it is replicated over."""
    if isinstance(t, DTensor):
        coords = t.device_mesh.get_coordinate()
        if not all(c == 0 for c, p in zip(coords, t.placements, strict=True) if isinstance(p, Replicate)):
            return False
        # Its mesh may lack tp, dp or cp: FSDP2 shards a tp-replicated weight (a norm) over dp (or
        # the flattened dp_cp) alone, so it is replicated over the dimensions its mesh does not have.
        names = {d for name in t.device_mesh.mesh_dim_names or () for d in name.split("_")}
        if "ep" in names:  # experts: sharded over ep and FSDP2's edp, which make up dp
            names.add("dp")
        return all(mesh[d].get_local_rank() == 0 for d in ("tp", "dp", "cp") if d not in names)
    # A plain parameter is the same on every tp, dp and cp rank of its stage.
    return all(mesh[d].get_local_rank() == 0 for d in ("tp", "dp", "cp"))


def _named_tensors(pm: ParallelModel, optimizer: torch.optim.Optimizer | None, trained_only: bool):
    """Parameters and their moments; `trained_only` (LoRA): the adapters, not the frozen base."""
    for name, p in pm.named_parameters():
        if trained_only and not p.requires_grad:
            continue
        yield name, p
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for kind in ADAMW_STATE_KINDS:
            if kind in state:
                yield optim_state_name(kind, name), state[kind]


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a permission): nothing of it was kept. Every
    rank raises it alike, naming the first rank's error."""


@dataclass
class Snapshot:
    """This rank's part of a checkpoint as of one moment (`snapshot`): the staging directory's
    writer, its file's pieces (name, global shape, box, tensor: copies, or the live tensors), its
    rank state, and what rank 0's manifest records besides the files."""

    writer: ArtifactWriter
    file: str
    pieces: list[tuple[str, list[int], Box, torch.Tensor]]
    rank_state: dict[str, torch.Tensor] | None
    manifest: dict
    ready: torch.cuda.Event | None = None  # the copies to the host done (a GPU's)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t in self.pieces)


def save_checkpoint(
    out: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    training: TrainingState | None = None,
    producer: tuple[str, str] = ("megacore", "0.1.0"),
    force: bool = False,
    inputs: Sequence[Path] = (),
    rank_state: dict[str, torch.Tensor] | None = None,
    on_written: Callable[[], None] | None = None,
    tokenizer: tuple[Path, TrainedTokenizer] | None = None,
    parents: Sequence[Parent] = (),
    license: License | None = None,
    adapter: Adapter | None = None,
) -> int:
    """Collective: every rank calls it with its part of the model (and optimizer) and its
    `rank_state`; `snapshot` of the live tensors, then `write_snapshot`. Returns the checkpoint's
    bytes; SaveFailed on every rank when a rank could not write its part (nothing is kept)."""
    snap = snapshot(
        out,
        pm,
        optimizer,
        training,
        producer,
        force,
        inputs,
        rank_state,
        tokenizer,
        parents,
        license,
        adapter,
    )
    return write_snapshot(snap, on_written=on_written)


def snapshot(
    out: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    training: TrainingState | None = None,
    producer: tuple[str, str] = ("megacore", "0.1.0"),
    force: bool = False,
    inputs: Sequence[Path] = (),
    rank_state: dict[str, torch.Tensor] | None = None,
    tokenizer: tuple[Path, TrainedTokenizer] | None = None,
    parents: Sequence[Parent] = (),
    license: License | None = None,
    adapter: Adapter | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> Snapshot:
    """Collective: the checkpoint's staging directory (rank 0 applies the output policy: `inputs`,
    the run's init checkpoint and data, are never written over nor into) and this rank's part of
    it. With `buffers` the pieces are copied into them (host memory, pinned on a GPU, allocated on
    the first snapshot and reused: training may then change the live tensors while the copy is
    written); without, they are the live tensors (write before training goes on). `tokenizer`: the
    one the weights were trained with and the directory its files are relative to (copied in by
    rank 0); `parents`: the lineage rank 0 records; `license`: the init's; `adapter` (LoRA): the
    checkpoint holds the adapters and their moments only, and names their base."""
    w = ArtifactWriter(_staging(out, inputs, force), "checkpoint")
    file, pieces = _pieces(pm, optimizer, adapter is not None)
    ready = None
    if buffers is not None:
        pieces = [(n, shape, box, _copy(buffers, n, t)) for n, shape, box, t in pieces]
        if rank_state is not None:
            rank_state = {k: _copy(buffers, f"rank_state.{k}", v) for k, v in rank_state.items()}
        if torch.cuda.is_available() and any(t.is_pinned() for *_, t in pieces):
            ready = torch.cuda.Event()
            ready.record()
    par = pm.par
    manifest = {
        "config": pm.config, "tokenizer": tokenizer, "parents": parents, "producer": producer,
        "dtype": dtype_of(next(pm.parameters())), "training": training, "license": license,
        "adapter": adapter,
        "layout": Layout(tp=par.spec.tp, pp=par.spec.pp, dp=pm.dims.replicas, stage_layers=pm.layers),
    }  # fmt: skip
    return Snapshot(w, file, pieces, rank_state, manifest, ready)


def host_buffers(
    pm: ParallelModel, optimizer: torch.optim.Optimizer | None, trained_only: bool
) -> dict[str, torch.Tensor]:
    """`snapshot`'s buffers for this rank's pieces, made ahead and touched: a fresh buffer's first
    write faults in every page (on a CPU, 1.5 s per GiB measured against 0.07 s for a copy into
    touched memory), which a background thread can pay while training goes on."""
    return {name: _host_buffer(t).zero_() for name, _, _, t in _pieces(pm, optimizer, trained_only)[1]}


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    """A host tensor like `t`: pinned where `t` is on a GPU, so copies into it need not wait for
    the device's queue."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


def _copy(buffers: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into its host buffer (made here if there is none yet)."""
    buf = buffers.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = buffers[name] = _host_buffer(t)
    return buf.copy_(t.detach(), non_blocking=t.is_cuda)


def write_snapshot(
    snap: Snapshot, group: dist.ProcessGroup | None = None, on_written: Callable[[], None] | None = None
) -> int:
    """Collective over `group` (every rank; the default group unless given: a background thread
    needs one of its own): every rank writes its files, then rank 0 commits the manifest once every
    rank's are written, or removes the staging directory when any rank failed. Returns the
    checkpoint's bytes (its files'); SaveFailed on every rank when a rank failed. `on_written`
    runs on every rank once its files are written, before the commit (fault-injection tests)."""
    cw = CheckpointWriter(snap.writer)
    rank = dist.get_rank()
    try:
        mine: tuple | str = _write_files(cw, snap, on_written)
    except Exception as e:  # whatever failed, every rank must still meet in the gather below
        mine = _failure(rank, e)
    try:
        gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=group)
        outcome: list = [None]
        if gathered is not None:
            outcome[0] = _commit(cw, snap, gathered)
        dist.broadcast_object_list(outcome, src=0, group=group)
    except BaseException:
        if rank == 0:
            snap.writer.abort()
        raise
    if isinstance(outcome[0], str):
        raise SaveFailed(outcome[0])
    return outcome[0]


def _write_files(cw: CheckpointWriter, snap: Snapshot, on_written: Callable[[], None] | None) -> tuple:
    """This rank's files of `snap`; the records rank 0 commits."""
    if snap.ready is not None:
        snap.ready.synchronize()
    if snap.pieces:
        cw.write_file(snap.file, snap.pieces)
    if snap.rank_state is not None:
        save_file(
            {k: v.contiguous().cpu() for k, v in snap.rank_state.items()},
            snap.writer.path(rank_state_file(dist.get_rank())),
        )
    if on_written is not None:
        on_written()
    return cw.records()


def _failure(rank: int, e: Exception) -> str:
    """A failed write in a line: an OSError names its file and why; anything else its type too."""
    return f"rank {rank}: {e}" if isinstance(e, OSError) else f"rank {rank}: {type(e).__name__}: {e}"


def _commit(cw: CheckpointWriter, snap: Snapshot, gathered: list) -> int | str:
    """Rank 0: the manifest over every rank's records, the checkpoint's bytes; or the first
    failure, the staging directory removed."""
    failed = next((g for g in gathered if isinstance(g, str)), None)
    if failed is None:
        try:
            for records in gathered[1:]:
                cw.merge(records)
            m = dict(snap.manifest)
            training = m["training"]
            if training is not None and snap.rank_state is not None:
                training.rng_files = [rank_state_file(r) for r in range(dist.get_world_size())]
            tokenizer = m.pop("tokenizer")
            done = cw.commit(
                **m, tokenizer=cw.add_tokenizer(*tokenizer) if tokenizer is not None else None,
                order=sorted(cw.tensor_names()),
            )  # fmt: skip
            return sum(f.size for f in done.files)
        except Exception as e:  # as a rank's write
            failed = _failure(0, e)
    snap.writer.abort()
    return failed


def _staging(out: Path, inputs: Sequence[Path], force: bool) -> Path:
    """Where every rank writes: rank 0 applies the output policy and stages the artifact, then
    every rank learns the path, or fails the same way (none waits forever): UserError for what
    the policy refuses, SaveFailed for what the disk does."""
    decided: list = [None, None, None]  # (path to write, refusal, failure) from rank 0
    if dist.get_rank() == 0:
        try:
            decided[0] = prepare_output(Path(out), "checkpoint", inputs=inputs, force=force)
            decided[0].parent.mkdir(parents=True, exist_ok=True)
            ArtifactWriter(decided[0], "checkpoint").stage()
        except UserError as e:
            decided[1] = str(e)
        except OSError as e:
            decided[2] = f"rank 0: {e}"
    dist.broadcast_object_list(decided, src=0)
    if decided[1] is not None:
        raise UserError(decided[1])
    if decided[2] is not None:
        raise SaveFailed(decided[2])
    return decided[0]


def _pieces(
    pm: ParallelModel, optimizer: torch.optim.Optimizer | None, trained_only: bool
) -> tuple[str, list[tuple[str, list[int], Box, torch.Tensor]]]:
    """This rank's file and the pieces it owns of every parameter and moment, in it."""
    mesh, dims = pm.mesh, pm.dims
    pp, tp, cp = (mesh[d].get_local_rank() for d in ("pp", "tp", "cp"))
    replica = dims.replica(dp_mesh(mesh).get_local_rank(), cp)  # of the weights' dp x cp shards
    file = shard_file(pp, tp, replica if dims.replicas > 1 else None)
    mine = []
    for name, t in _named_tensors(pm, optimizer, trained_only):
        offset, shape, local = local_piece(t.detach())
        if _owner(t, mesh) and local.numel():
            mine.append((name, list(t.shape), (offset, shape), local))
    return file, mine


@torch.no_grad()
def load_checkpoint(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    ignore: tuple[str, ...] = TOKEN_ID_FIELDS,
    only: Callable[[str], bool] | None = None,
) -> CheckpointManifest:
    """Fill this rank's parameters (and AdamW moments, when the checkpoint has them) from a
    checkpoint of any layout, reading only the slices this rank holds. `DamagedFile` when a file
    read is damaged; the parameters and moments may then hold some of its values. The checkpoint's
    config must be the model's, but for the fields in `ignore` (a run's init: its context too).
    `only`: the parameters to fill, by name (LoRA: the frozen base from its checkpoint, the
    adapters from theirs), else all."""
    with CheckpointReader(path) as ckpt:
        diff = config_differences(pm.config, ckpt.config, ignore)
        if diff:
            raise UserError(f"the checkpoint's model config differs from the run's in {diff}", str(path))
        tensors = ckpt.manifest.tensors
        training = ckpt.manifest.training
        step = 0 if training is None else training.step
        if training is not None and training.optimizer_steps is not None:
            step = training.optimizer_steps  # AdamW's bias correction counts applied updates
        for name, p in pm.loaded_parameters():  # a tied output copy from embed.weight
            if only is not None and not only(name):
                continue
            entry = ckpt.entry(name)
            if list(entry.shape) != list(p.shape):
                raise UserError(
                    f"tensor {name!r} has shape {entry.shape}, the model needs {list(p.shape)}", str(path)
                )
            offset, shape, local = local_piece(p)
            if is_nf4(local):  # quantized whole, as one process quantizes it (QLoRA's base)
                fill(p, ckpt.read(name), offset, shape)
            elif local.numel():
                local.copy_(ckpt.read(name, (offset, shape)))
            kinds = [k for k in ADAMW_STATE_KINDS if optim_state_name(k, name) in tensors]
            if optimizer is None or not kinds:
                continue
            state = optimizer.state[p]
            state["step"] = torch.tensor(float(step))
            for kind in kinds:
                buf = torch.zeros_like(p)
                _, _, loc = local_piece(buf)
                if loc.numel():
                    loc.copy_(ckpt.read(optim_state_name(kind, name), (offset, shape)))
                state[kind] = buf
        # The files' sums, hashed meanwhile: a damaged file is DamagedFile here, before the caller
        # trains on what was copied (a run then falls back to an older checkpoint).
        ckpt.confirm()
        return ckpt.manifest


def rank_state_file(rank: int) -> str:
    return f"rank-state/rank-{rank:05d}.safetensors"


def load_rank_state(path: Path, manifest: CheckpointManifest) -> dict[str, torch.Tensor] | None:
    """This rank's `rank_state` from a checkpoint saved by a job of the same world size, else None;
    its file checked against the manifest first, sha256 included (it is small), like the tensors."""
    training = manifest.training
    rel = rank_state_file(dist.get_rank())
    if training is None or len(training.rng_files) != dist.get_world_size() or rel not in training.rng_files:
        return None
    i, entry = next((i, e) for i, e in enumerate(manifest.files) if e.path == rel)
    return load_file(str(check_file(Path(path), entry, f"{path}: $.files[{i}]")))
