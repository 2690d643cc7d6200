"""Saving and loading a live (parallel) model's state as a checkpoint artifact.

Save: every rank writes one file (`shard_file`) with the pieces it owns (its shard of each parameter
and of its AdamW moments, `optim.<kind>.<param>`); a piece replicated over some mesh dims is written
by the rank at coordinate 0 of those dims only, so the pieces tile every tensor exactly once. Rank 0
applies the output policy, gathers the others' records and commits the one manifest
(`megacore.checkpoint.CheckpointWriter`). Per-rank state that is no tensor of the model (RNG states)
goes into `rank-state/rank-NNNNN.safetensors`, listed in `training.rng_files`.

Load: every rank reads only the slices its parameters (and moments) need, from whatever layout the
checkpoint has (`megacore.checkpoint.CheckpointReader`), so a run resumes with other tp/pp/dp sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, Replicate

from megacore.artifacts import ArtifactWriter, CheckpointManifest, prepare_output
from megacore.artifacts.manifest import Adapter, Layout, License, Parent, TrainedTokenizer, TrainingState
from megacore.artifacts.reader import check_file
from megacore.checkpoint import CheckpointReader, CheckpointWriter, dtype_of, shard_file
from megacore.config import TOKEN_ID_FIELDS, config_differences
from megacore.errors import UserError
from megacore.models.nf4 import fill, is_nf4
from megacore.parallel.engine import ParallelModel, local_piece
from megacore.parallel.layout import ADAMW_STATE_KINDS, optim_state_name
from megacore.parallel.mesh import dp_mesh


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
) -> None:
    """Collective: every rank calls it with its part of the model (and optimizer) and its
    `rank_state`. `inputs` (the run's init checkpoint and data) are never written over, nor into
    (the output policy). `on_written` runs on every rank once its files are written, before the
    commit (a point for fault-injection tests). `tokenizer`: the one the weights were trained
    with and the directory its files are relative to (copied in by rank 0); `parents`: the
    lineage rank 0 records (the run's init checkpoint and data); `license`: the init's; `adapter`
    (LoRA): the checkpoint holds the adapters and their moments only, and names their base."""
    w = ArtifactWriter(_staging(out, inputs, force), "checkpoint")
    try:
        cw = CheckpointWriter(w)
        _write_pieces(cw, pm, optimizer, adapter is not None)
        if rank_state is not None:
            save_file(
                {k: v.contiguous().cpu() for k, v in rank_state.items()},
                w.path(rank_state_file(dist.get_rank())),
            )
        if on_written is not None:
            on_written()
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(cw.records(), gathered, dst=0)
        if gathered is not None:
            for records in gathered[1:]:
                cw.merge(records)
            if training is not None and rank_state is not None:
                training.rng_files = [rank_state_file(r) for r in range(dist.get_world_size())]
            par = pm.par
            cw.commit(
                config=pm.config,
                tokenizer=cw.add_tokenizer(*tokenizer) if tokenizer is not None else None,
                parents=parents,
                dtype=dtype_of(next(pm.parameters())),
                layout=Layout(tp=par.spec.tp, pp=par.spec.pp, dp=pm.dims.replicas, stage_layers=pm.layers),
                producer=producer,
                training=training,
                license=license,
                adapter=adapter,
                order=sorted(cw.tensor_names()),
            )
    except BaseException:
        if dist.get_rank() == 0:
            w.abort()
        raise
    dist.barrier()


def _staging(out: Path, inputs: Sequence[Path], force: bool) -> Path:
    """Where every rank writes: rank 0 applies the output policy and stages the artifact, then
    every rank learns the path, or fails the same way (none waits forever)."""
    decided: list = [None, None]  # (path to write, refusal) from rank 0
    if dist.get_rank() == 0:
        try:
            decided[0] = prepare_output(Path(out), "checkpoint", inputs=inputs, force=force)
            decided[0].parent.mkdir(parents=True, exist_ok=True)
            ArtifactWriter(decided[0], "checkpoint").stage()
        except UserError as e:
            decided[1] = str(e)
    dist.broadcast_object_list(decided, src=0)
    if decided[1] is not None:
        raise UserError(decided[1])
    return decided[0]


def _write_pieces(
    cw: CheckpointWriter, pm: ParallelModel, optimizer: torch.optim.Optimizer | None, trained_only: bool
) -> None:
    """This rank's file: the pieces it owns of every parameter and moment."""
    mesh, dims = pm.mesh, pm.dims
    pp, tp, cp = (mesh[d].get_local_rank() for d in ("pp", "tp", "cp"))
    replica = dims.replica(dp_mesh(mesh).get_local_rank(), cp)  # of the weights' dp x cp shards
    file = shard_file(pp, tp, replica if dims.replicas > 1 else None)
    mine = []
    for name, t in _named_tensors(pm, optimizer, trained_only):
        offset, shape, local = local_piece(t.detach())
        if _owner(t, mesh) and local.numel():
            mine.append((name, list(t.shape), (offset, shape), local))
    if mine:
        cw.write_file(file, mine)


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
