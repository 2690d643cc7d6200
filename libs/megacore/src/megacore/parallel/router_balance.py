"""A mixture of experts' router losses weighed into a step's gradients, its statistics gathered, and
DeepSeek V3's bias balancing.

The model's router loss is each MoE layer's load-balancing and z-loss, a mean over layers and over
the global batch's microbatches, times the run's coefficients (`RouterLosses`). Each rank's losses are means over
its tokens (its rows, or under cp its part of them): the replicas' average of those is the global
mean, so `weigh` needs no weighting up beyond the rank's share. `report` gathers every step's
statistics from every rank (a collective) as device scalars, nothing read back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megacore.config import ModelConfig, RouterLosses, sparse_layer
from megacore.models.moe import MoE
from megacore.parallel.pieces import box_slice, local_piece


class RouterBalance:
    """This rank's MoE layers (`moe_layers`, by global index) and the step's router bookkeeping."""

    def __init__(
        self, config: ModelConfig, losses: RouterLosses, moe_layers: dict[int, MoE], tp: int, replicas: int
    ) -> None:
        self.config, self.losses, self.moe_layers = config, losses, moe_layers
        self.tp, self.replicas = tp, replicas
        self.sparse = [i for i in range(config.num_layers) if sparse_layer(config, i)]

    def weigh(self, share: float) -> None:
        """Each MoE layer's load-balancing and z-loss gradient weights for this step (`share`: this
        rank's part of the mean, gradient averaging over the replicas and the step's scale
        included), and its statistics reset."""
        layers = len(self.sparse)
        for moe in self.moe_layers.values():
            moe.aux_weight = self.losses.aux_loss_coef * share / layers
            moe.z_weight = self.losses.z_loss_coef * share / layers
            moe.stats.reset()

    def report(self, microbatches: int, device: torch.device) -> dict[str, torch.Tensor] | None:
        """The step's router statistics over every layer and rank (a collective), device scalars:
        the mean load-balancing and z-loss (as `weigh` weighs them, without coefficients) and the
        tokens each expert of each layer got: min, max and coefficient of variation."""
        if self.config.moe is None:
            return None
        layers, experts = len(self.sparse), self.config.moe.num_experts
        table = torch.zeros(layers, experts + 2, dtype=torch.float64, device=device)
        for i, moe in self.moe_layers.items():
            load, losses = moe.stats.totals(last=microbatches)
            row = self.sparse.index(i)
            table[row, :experts], table[row, experts:] = load.double(), losses.double()
        dist.all_reduce(table)
        table /= self.tp  # every tp rank routes the same tokens
        load = table[:, :experts]
        if self.losses.bias_update:
            self._balance(load)
        mean = load.mean()
        losses = table[:, experts:].sum(0) / (layers * microbatches * self.replicas)
        cv = torch.where(mean > 0, load.std(correction=0) / mean, torch.zeros_like(mean))
        return {
            "aux_loss": losses[0],
            "z_loss": losses[1],
            "expert_load_min": load.min(),
            "expert_load_max": load.max(),
            "expert_load_cv": cv,
        }

    def _balance(self, load: torch.Tensor) -> None:
        """DeepSeek V3's auxiliary-loss-free balancing: each MoE layer's router bias moved by
        `RouterLosses.bias_update` towards even loads, up for an expert below the layer's mean load and
        down above it, from this step's loads over every rank (the same on every rank: each moves
        its own piece of the bias, which the optimizer never touches)."""
        step = torch.sign(load.mean(dim=1, keepdim=True) - load) * self.losses.bias_update
        with torch.no_grad():
            for i, moe in self.moe_layers.items():
                offset, shape, local = local_piece(moe.router_bias)
                local.add_(box_slice(step[self.sparse.index(i)], (offset, shape)).to(local.dtype))
