"""What the engine's microbatches sum: a `Loss` turns a microbatch's output into its summed loss.

The engine (`engine.ParallelModel`) runs the stages and the schedule; what a step minimises comes in
as an argument of `forward_backward` and `evaluate`, so the engine names no objective. A loss says:

- `count(targets, positions)`: what the step's mean divides by on this rank's whole rows (counted
  targets for a token loss, pairs for a loss over sequences' sums), a device tensor;
- `per_token`: its sum is over tokens, so under cp the ranks' parts of a row add up (else it is
  over whole rows already, and every cp rank holds the same);
- `fused`: the reduction of the fused output projection and cross entropy it can take
  (`models.loss.fused_linear_cross_entropy`: `sum`, or `rows` for each row's sum), or None when it
  needs the logits; the engine uses it where the layout allows (`build_rules.fused_loss`);
- `of_fused(mb, value)` and `of_logits(mb, logits)`: the microbatch's summed loss from either.

`Loss` itself is language modelling's: cross entropy summed over the counted targets, vocab-parallel
under tp (`tp.lm_loss`); the others derive from it. A loss over each sequence's summed log-probability is `row_sums.RowSums`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from megacore.data.packing import IGNORE
from megacore.parallel.tp import lm_loss


@dataclass
class Microbatch:
    """A microbatch as the loss sees it: its number in this rank's batch, its inputs where this rank
    holds them (without a pipeline; else None), its targets (this rank's part under cp) and the
    stage inputs (positions, segments)."""

    index: int
    tokens: torch.Tensor | None
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


class Loss:
    """A microbatch's summed loss (module docstring); this base is the token cross entropy."""

    per_token = True
    fused: str | None = "sum"

    def __init__(self, vocab_size: int, tp_mesh: DeviceMesh | None) -> None:
        self.vocab_size, self.tp_mesh = vocab_size, tp_mesh

    def count(self, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return (targets != IGNORE).sum()

    def of_fused(self, mb: Microbatch, value: torch.Tensor) -> torch.Tensor:
        return value

    def of_logits(self, mb: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, mb.targets, self.vocab_size, self.tp_mesh, "sum")

    def token_logps(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each target's log-probability [b, s] from (vocab-parallel) logits, 0 where it does not
        count."""
        return -lm_loss(logits, targets, self.vocab_size, self.tp_mesh, "none").reshape(targets.shape)
