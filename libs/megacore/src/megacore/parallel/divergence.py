"""Divergences between two models' token distributions, vocab-parallel under tp.

For each position, with p the teacher's and q the student's distribution over the vocab (each the
softmax of its logits over `temperature`):

- `forward_kl`: KL(p ‖ q) = Σ p (log p − log q), the usual distillation loss (Hinton et al. 2015);
- `reverse_kl`: KL(q ‖ p) = Σ q (log q − log p), mode-seeking (MiniLLM, Gu et al. 2024);
- `jsd`: ½ KL(p ‖ m) + ½ KL(q ‖ m), m = ½ (p + q) (GKD's generalised JSD at β = ½, Agarwal et
  al. 2024).

Under tp each rank holds its vocab shard of both logits [.., V/tp]: the log-softmax's max and sum
and the divergence's sum over the vocab are reduced over tp, never gathering the whole vocab. Each
reduction is an all-reduce forward; backward, the divergence's sum hands its gradient on as it is
(every tp rank goes on with the same sum to the same loss: Megatron's reduce from the tp region),
while the softmax's normaliser all-reduces its gradient too (each rank's own vocab terms give only
their part of it). Vocab padding columns (≥ `vocab_size`) are cut off before anything is computed.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megacore.data.packing import IGNORE

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def token_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    targets: torch.Tensor,
    kind: Divergence,
    temperature: float,
    vocab_size: int,
    tp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The divergence's sum over the counted positions (targets not IGNORE) of logits [b, s, V_local]
    (this rank's vocab shard under tp), in fp32; the gradient flows to `student` only."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    local_v = student.shape[-1]
    start = tp_mesh.get_local_rank() * local_v if tp > 1 else 0
    keep = max(0, min(local_v, vocab_size - start))  # vocab padding cut off
    mesh = tp_mesh if tp > 1 else None
    log_q = _log_softmax(student[..., :keep].float() / temperature, mesh)
    log_p = _log_softmax(teacher[..., :keep].detach().float() / temperature, mesh)
    if kind == "forward_kl":
        terms = log_p.exp() * (log_p - log_q)
    elif kind == "reverse_kl":
        terms = log_q.exp() * (log_q - log_p)
    else:
        log_m = torch.logaddexp(log_p, log_q) - math.log(2)
        terms = 0.5 * (log_p.exp() * (log_p - log_m) + log_q.exp() * (log_q - log_m))
    per_token = _vocab_sum(terms.sum(-1), mesh)
    return torch.where(targets != IGNORE, per_token, 0.0).sum()


def _log_softmax(z: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """log softmax over the last dim, whose shards are spread over `mesh` (None: whole here)."""
    if mesh is None:
        return torch.log_softmax(z, dim=-1)
    top = z.detach().amax(-1, keepdim=True) if z.shape[-1] else z.new_full((*z.shape[:-1], 1), -torch.inf)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh.get_group())  # any shift would do: no gradient
    total = _vocab_sum((z - top).exp().sum(-1, keepdim=True), mesh, partial_grad=True)
    return z - top - total.log()


def _vocab_sum(part: torch.Tensor, mesh: DeviceMesh | None, partial_grad: bool = False) -> torch.Tensor:
    """The sum over the tp ranks of each one's part of a sum over the vocab. `partial_grad`: what
    comes after it on each rank gives only part of its gradient (the ranks' parts are summed)."""
    if mesh is None:
        return part
    return _SumOverTp.apply(part, mesh.get_group(), partial_grad)


class _SumOverTp(torch.autograd.Function):
    """All-reduce (sum) forward; backward the identity, or an all-reduce of partial gradients."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: dist.ProcessGroup, partial_grad: bool) -> torch.Tensor:
        ctx.group, ctx.partial_grad = group, partial_grad
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.partial_grad:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None
