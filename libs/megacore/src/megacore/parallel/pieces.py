"""A parameter's piece on this rank: where a DTensor's shard sits in the whole tensor, and that box
cut out of a whole tensor (loading, initialising, moving a router bias)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megacore.artifacts.pieces import Box


def local_piece(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global offset, local shape, local tensor) of a DTensor's shard on this rank, or of a plain tensor."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape), t.to_local()
    return (0,) * t.ndim, tuple(t.shape), t


def box_slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    offset, shape = box
    return t[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
