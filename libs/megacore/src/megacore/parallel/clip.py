"""The global gradient norm and clipping over every parameter of a parallel model, DTensor (any
mesh) and plain alike, without reading anything back to the host: the norm stays a device tensor
and the clip factor is applied as one (torch's `clip_grad_norm_` pattern), so a step does not
wait for its gradients here (docs/architecture.md, "The training loop")."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of gradients sharing a mesh and placements (or plain ones). Over several
    mesh dims (dp x tp, edp x ep x tp) DTensor all-reduces once per dim and warns that a flattened
    mesh would take one all-reduce: for one scalar a step, not worth the process groups (NCCL
    communicators) a flattened mesh costs, so that warning is kept off."""
    if isinstance(grads[0], DTensor) and _out_of_order(grads[0].device_mesh):
        return _sharded_norm(grads)
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        return n.full_tensor() if isinstance(n, DTensor) else n
    finally:
        log.setLevel(level)


def _out_of_order(mesh) -> bool:
    """A mesh whose dims are not in the root mesh's order: the experts' under ep x cp, (edp x cp,
    ep), FSDP2's flattened dim before ep's. DTensor's reductions over it fail in torch 2.13 (it
    looks for a flattened mesh of those dims and slices them, which needs ascending order)."""
    names, layout = mesh.mesh_dim_names, getattr(mesh, "_get_slice_mesh_layout", None)
    if names is None or len(names) < 2 or layout is None:  # a torch without that lookup
        return False
    try:
        layout(names)
    except KeyError:
        return True
    return False


def _sharded_norm(grads: list[DTensor]) -> torch.Tensor:
    """The global 2-norm of DTensor gradients sharded (or replicated) on each mesh dim: the local
    squares summed over the dims they are sharded on."""
    sq = sum(g.to_local().float().pow(2).sum() for g in grads)
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(p.is_partial() for p in placements):
        raise NotImplementedError(f"a norm of partial gradients over {mesh}")
    for dim, p in enumerate(placements):
        if p.is_shard():
            dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float, pp_group=None, uncounted: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip the global 2-norm of the gradients to `max_norm` (inf: no clipping); returns the norm
    before clipping, a device tensor. DTensor (any mesh) and plain parameters may be mixed.
    `uncounted`: a parameter whose gradient is clipped but left out of the norm (a tied output
    copy: its gradient is the embedding's, counted there).

    torch's clip_grad_norm_ cannot mix them, so norms are taken per group of gradients sharing a
    mesh and placements (DTensor reductions make each group's norm global) and combined; with
    pipeline parallel the squares are summed over the stages. Plain parameters are replicated
    (identical on every rank holding them) and counted once. The gradients are multiplied by
    min(1, max_norm / norm), computed on the device: by exactly 1 when the norm is within bounds."""
    grads = [p.grad for p in params if p.grad is not None and p is not uncounted]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for gs in groups.values():
        total_sq = total_sq + _group_norm(gs).float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm == float("inf"):
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for gs in groups.values():
        torch._foreach_mul_(gs, coef)
    if uncounted is not None and uncounted.grad is not None:
        uncounted.grad.mul_(coef)
    return total
