"""Tied embeddings under pipeline parallel, as Megatron shares them: the first stage holds the
embedding, the last stage a copy of it as its output layer (`copy`, filled from `embed.weight` and
never saved). After every step's backward their gradients are summed (over a group of the two
stages' ranks, or in place where one rank holds both: ZBV), so the optimizer keeps them equal;
clipping counts the shared gradient once (`clip.clip_grad_norm`'s `uncounted`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megacore.parallel.layout import Parallelism
from megacore.parallel.pieces import local_piece


class TiedEmbeddings:
    """This rank's ends of a pipeline's shared embedding: `embed` (first stage) and `copy` (last),
    either or both or neither."""

    def __init__(
        self,
        embed: nn.Parameter | None,
        copy: nn.Parameter | None,
        mesh: DeviceMesh,
        par: Parallelism,
        stages: int,
    ) -> None:
        self.embed, self.copy = embed, copy
        self.group = _pair_group(mesh, par, stages)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """The shared embedding's gradient, the embedding's and its output copy's summed, on both."""
        embed, copy = self.embed, self.copy
        for p in (embed, copy):
            # The vocab-parallel embedding's gradient comes out of DTensor's backward replicated
            # over tp; the copy's is sharded like its weight. Compare like with like.
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        if embed is not None and copy is not None:  # one rank holds both ends
            total = embed.grad + copy.grad
            embed.grad.copy_(total)
            copy.grad.copy_(total)
        elif embed is not None or copy is not None:
            grad = (embed if embed is not None else copy).grad
            dist.all_reduce(local_piece(grad)[2], group=self.group)


def _pair_group(mesh: DeviceMesh, par: Parallelism, stages: int) -> dist.ProcessGroup | None:
    """The group of this rank and the rank at the other end of its pipeline (first stage's rank
    and last stage's, same dp and tp coordinates); None where one rank holds both ends. Every rank
    builds every pair's group (a collective), middle stages included."""
    pp = mesh["pp"].size()
    owner = {s: r for r in range(pp) for s in par.rank_stages(r)}
    first, last = owner[0], owner[stages - 1]
    if first == last:
        return None
    grid = mesh.mesh.flatten(1)  # global ranks by pp, then (dp, cp, tp)
    pairs = [[int(grid[first, i]), int(grid[last, i])] for i in range(grid.shape[1])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group
