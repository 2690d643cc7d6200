"""Saving and loading a live (parallel) model in the checkpoint artifact format.

Save: every rank writes one safetensors file (`model-ppXX-tpXX-dpXX.safetensors`) with the pieces it
owns (its shard of each parameter and of its AdamW moments, `optim.<kind>.<param>`); a piece
replicated over some mesh dims is written by the rank at coordinate 0 of those dims only, so the
pieces tile every tensor exactly once. After a barrier rank 0 gathers the piece lists and writes the
one manifest describing the union (staged in `<out>.partial/`, renamed into place at the end).

Load: every rank reads only the slices its parameters (and moments) need, from whatever layout the
checkpoint has (TensorReader), so a run can resume with other tp/pp/dp sizes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from megacore.artifacts import (
    ArtifactWriter,
    CheckpointManifest,
    Piece,
    SafetensorsStreamWriter,
    TensorReader,
    dtype_name,
    new_header_fields,
    open_artifact,
    piece_entry,
)
from megacore.artifacts.manifest import MANIFEST_NAME, Layout, TrainingState
from megacore.errors import UserError
from megacore.parallel.engine import ParallelModel, local_piece
from megacore.parallel.plan import ADAMW_STATE_KINDS, optim_state_name


def _owner(t: torch.Tensor, mesh) -> bool:
    """Whether this rank writes its piece of `t`: coordinate 0 on every dim it is replicated over."""
    if isinstance(t, DTensor):
        coords = t.device_mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coords, t.placements, strict=True) if isinstance(p, Replicate))
    # A plain parameter is the same on every tp and dp rank of its stage.
    return mesh["tp"].get_local_rank() == 0 and mesh["dp"].get_local_rank() == 0


def _named_tensors(pm: ParallelModel, optimizer: torch.optim.Optimizer | None):
    for name, p in pm.named_parameters():
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
) -> None:
    """Collective: every rank calls it with its part of the model (and optimizer)."""
    out = Path(out)
    mesh, rank = pm.mesh, dist.get_rank()
    writer = ArtifactWriter(out)
    if rank == 0:
        if out.exists() and not force and (out / MANIFEST_NAME).is_file():
            raise UserError("already exists; pass force to overwrite", str(out))
        shutil.rmtree(writer.dir, ignore_errors=True)
        writer.dir.mkdir(parents=True)
    dist.barrier()
    pp_r, tp_r, dp_r = (mesh[d].get_local_rank() for d in ("pp", "tp", "dp"))
    fname = f"model-pp{pp_r:02d}-tp{tp_r:02d}-dp{dp_r:02d}.safetensors"
    mine = []  # (name, global shape, dtype, offset, local tensor)
    for name, t in _named_tensors(pm, optimizer):
        offset, shape, local = local_piece(t.detach())
        if _owner(t, mesh) and local.numel():
            mine.append((name, list(t.shape), dtype_name(local.dtype), list(offset), local))
    if mine:
        sw = SafetensorsStreamWriter(
            writer.path(fname), [(n, d, list(loc.shape)) for n, _, d, _, loc in mine]
        )
        for n, _, _, _, loc in mine:
            sw.write(n, loc)
        sha = sw.close()
        record = (fname, sha, sw.size)
    else:
        record = None
    pieces = [
        (n, shape, d, Piece(file=fname, key=n, offset=off, shape=list(loc.shape)))
        for n, shape, d, off, loc in mine
    ]
    gathered: list = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((record, pieces), gathered, dst=0)
    if rank == 0:
        tensors: dict[str, tuple[list[int], str, list[Piece]]] = {}
        for rec, ps in gathered:
            if rec is not None:
                writer.record(rec[0], rec[1], rec[2])
            for n, shape, d, piece in ps:
                tensors.setdefault(n, (shape, d, []))[2].append(piece)
        entries = {n: piece_entry(shape, d, ps) for n, (shape, d, ps) in sorted(tensors.items())}
        par = pm.par
        manifest = CheckpointManifest(
            **new_header_fields(*producer),
            config=pm.config,
            dtype=entries[next(iter(entries))].dtype,
            layout=Layout(tp=par.tp, pp=par.pp, dp=pm.dp, stage_layers=pm.layers),
            tensors=entries,
            training=training,
        )
        writer.commit(manifest)
    dist.barrier()


@torch.no_grad()
def load_checkpoint(
    path: Path, pm: ParallelModel, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointManifest:
    """Fill this rank's parameters (and AdamW moments, when the checkpoint has them) from a
    checkpoint of any layout, reading only the slices this rank holds."""
    manifest = open_artifact(path, "checkpoint", verify="size")
    root = Path(path)
    want = {k: v for k, v in msgspec_items(pm.config).items() if k not in ("bos_id", "eos_id")}
    have = {k: v for k, v in msgspec_items(manifest.config).items() if k not in ("bos_id", "eos_id")}
    if want != have:
        diff = sorted(k for k in want if want[k] != have.get(k))
        raise UserError(f"the checkpoint's model config differs from the run's in {diff}", str(root))
    step = manifest.training.step if manifest.training is not None else 0
    with TensorReader(root) as reader:
        for name, p in pm.named_parameters():
            entry = manifest.tensors.get(name)
            if entry is None:
                raise UserError(f"tensor {name!r} is missing", str(root))
            if list(entry.shape) != list(p.shape):
                raise UserError(
                    f"tensor {name!r} has shape {entry.shape}, the model needs {list(p.shape)}", str(root)
                )
            offset, shape, local = local_piece(p)
            if local.numel():
                local.copy_(reader.read(name, entry, (offset, shape)))
            if optimizer is None:
                continue
            kinds = [k for k in ADAMW_STATE_KINDS if optim_state_name(k, name) in manifest.tensors]
            if not kinds:
                continue
            state = optimizer.state[p]
            state["step"] = torch.tensor(float(step))
            for kind in kinds:
                buf = torch.zeros_like(p)
                _, _, loc = local_piece(buf)
                if loc.numel():
                    loc.copy_(
                        reader.read(
                            optim_state_name(kind, name),
                            manifest.tensors[optim_state_name(kind, name)],
                            (offset, shape),
                        )
                    )
                state[kind] = buf
    return manifest


def msgspec_items(struct) -> dict:
    import msgspec

    return msgspec.structs.asdict(struct)
