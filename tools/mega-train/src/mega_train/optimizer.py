"""The optimizer a run steps with and the gradients it steps on: AdamW in its weight-decay groups
(`make_optimizer`), and the gradients unscaled by fp16's loss scale and clipped to a global norm
(`unscale_and_clip`), whose value before clipping is what a run reports. `Trainer.step` uses both.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from megacore.artifacts.run_spec import OptimizerSpec
from megacore.parallel.clip import clip_grad_norm


def make_optimizer(params: list[torch.nn.Parameter], opt: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW; norms and biases (1-D) are not decayed. Vocab padding rows get no gradient and so stay
    zero. DTensor and plain parameters go in groups of their own: the fused kernel takes one kind
    per group (under tp without sequence parallel the norms are plain, the q/k norms DTensors)."""
    groups = []
    for decayed in (True, False):
        for dtensor in (True, False):
            mine = [p for p in params if (p.ndim >= 2) == decayed and isinstance(p, DTensor) == dtensor]
            if mine:
                groups.append({"params": mine, "weight_decay": opt.weight_decay if decayed else 0.0})
    return torch.optim.AdamW(groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, fused=True)


@torch.no_grad()
def unscale_and_clip(
    params: list[torch.Tensor],
    scale: float,
    clip: float,
    pp_group=None,
    uncounted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divide the gradients by the loss scale, then clip them to global norm `clip` (0: no clipping);
    returns the norm before clipping, of the unscaled gradients (what a run reports), on the
    device. `uncounted`: a tied output copy, clipped but not counted (`clip_grad_norm`)."""
    if scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)
    return clip_grad_norm(params, clip or math.inf, pp_group, uncounted)
