"""The device mesh (`pp`, `dp`, `cp`, `tp`) from torchrun's environment: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megacore import env
from megacore.parallel.layout import Dims

MESH_DIMS = ("pp", "dp", "cp", "tp")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> None:
    """Initialise the default process group from torchrun's variables (RANK, WORLD_SIZE, ...), or
    a group of one process when they are absent (a plain `python` or console-script run).

    Under torchrun the store is its agent's, which outlives the workers: after a restart
    (`--max-restarts`) the new workers would find the dead ones' keys there (Gloo's addresses of
    each rank: connecting to them is refused, and the first restart failed), so each start's keys
    go under a prefix of their own (TORCHELASTIC_RESTART_COUNT)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type() == "cuda" else "gloo"
    if device_type() == "cuda":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    if env.get("RANK") is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mega-train/start-{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def build_mesh(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> DeviceMesh:
    """A 4-D mesh (pp, dp, cp, tp) over the whole world; dp = world / (tp * pp * cp). tp is the
    innermost dimension so a tensor-parallel group is made of neighbouring ranks (one node on
    GPUs), cp next: its all-gathers of keys and values are the next heaviest traffic. With expert
    parallel, dp is made of (edp, ep), flattened to `dp` (the mesh has both): ep's neighbouring
    ranks exchange tokens, edp's hold the same experts."""
    init_distributed()
    dp = Dims.for_world(dist.get_world_size(), tp, pp, cp, ep).dp
    if ep == 1:
        return init_device_mesh(device_type(), (pp, dp, cp, tp), mesh_dim_names=MESH_DIMS)
    mesh = init_device_mesh(
        device_type(), (pp, dp // ep, ep, cp, tp), mesh_dim_names=("pp", "edp", "ep", "cp", "tp")
    )
    mesh["edp", "ep"]._flatten("dp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dim of a `build_mesh` mesh. Under expert parallel it is the flattened
    (edp, ep), which torch deprecates slicing off the root mesh (a warning on every rank): flattening
    again returns the same mesh and process group."""
    if mesh.mesh_dim_names is not None and "ep" in mesh.mesh_dim_names:
        return mesh["edp", "ep"]._flatten("dp")
    return mesh["dp"]


def replicas_mesh(mesh: DeviceMesh, cp: int) -> DeviceMesh:
    """What FSDP2 shards parameters over: the ranks holding the same ones, dp, or with cp dp x cp
    flattened (cp's ranks hold the same weights for other parts of the rows)."""
    if cp == 1:
        return dp_mesh(mesh)
    dp = ("edp", "ep") if mesh.mesh_dim_names is not None and "ep" in mesh.mesh_dim_names else ("dp",)
    return mesh[(*dp, "cp")]._flatten("dp_cp")


def experts_replicas_mesh(mesh: DeviceMesh, cp: int) -> DeviceMesh:
    """Under expert parallel, what FSDP2 shards the experts over: the ranks holding the same
    experts, edp, or with cp edp x cp flattened (not neighbours in the mesh: ep lies between)."""
    return mesh["edp", "cp"]._flatten("edp_cp") if cp > 1 else mesh["edp"]


def shutdown() -> None:
    """A barrier before destroying the group: an exit without it can abort other ranks on gloo."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
