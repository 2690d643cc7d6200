"""GRPO's loss on the engine (`megacore.models.grpo`): a row holds a prompt and one sampled
completion, and the completion's tokens are the counted targets.

Per microbatch, from the (vocab-parallel) logits over the sampling temperature (the distribution the
completions were drawn from, as TRL takes its log-probabilities), each counted target's
log-probability goes into `grpo.token_losses` with what the objective computed for it when the
completions were made (`PolicyInputs`, by microbatch number; the policy's entropy at each token,
a metric, from the same logits: `token_entropy`): the sampling policy's and the
reference's log-probabilities, its completion's advantage and token weight. The weights are scaled
by the global batch's completions N, and a rank counts its rows (one completion each), so the
engine's mean over the global count N is Σ w ℓ, the batch's loss in any layout. Each microbatch's
metric sums are kept (`stats`) for the objective to add up over microbatches and ranks. The sampler
does not run under cp, so neither does this loss: whole rows on every rank.

`TokenLogps` is the forward alone (`ParallelModel.evaluate`) that keeps each target's
log-probability at the temperature, on every rank (vocab-parallel under tp): the sampling policy's
and the reference's, computed once for a batch of completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megacore.data.packing import IGNORE
from megacore.models.grpo import Clip, TokenStats, token_losses
from megacore.parallel.losses import Loss, Microbatch


@dataclass
class PolicyInputs:
    """One microbatch's per-token inputs, [b, s] like its targets (what is not a counted target is
    never read): the sampling policy's log-probabilities (None: the policy's own, detached, when a
    batch of completions is used once), the reference's (None: β = 0), the completion's advantage
    and its token weight × N, and the completion's row (for sequence-level ratios)."""

    old: torch.Tensor | None
    ref: torch.Tensor | None
    advantages: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor


class PolicyLoss(Loss):
    """GRPO's clipped surrogate and KL penalty over the completion tokens (module docstring)."""

    fused = None  # it reads each token's log-probability
    per_token = True

    def __init__(
        self,
        vocab_size: int,
        tp_mesh: DeviceMesh | None,
        clip: Clip,
        temperature: float,
        inputs: dict[int, PolicyInputs],
    ) -> None:
        super().__init__(vocab_size, tp_mesh)
        self.clip, self.temperature, self.inputs = clip, temperature, inputs
        self.stats: dict[int, TokenStats] = {}

    def count(self, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The rank's completions: one a row."""
        return torch.tensor(targets.shape[0], device=targets.device)

    def of_logits(self, mb: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        scaled = logits.float() / self.temperature
        logps = self.token_logps(scaled, mb.targets)
        x, keep = self.inputs[mb.index], mb.targets != IGNORE
        mine = logps[keep]
        entropy = token_entropy(scaled.detach(), self.vocab_size, self.tp_mesh)[keep]
        loss, self.stats[mb.index] = token_losses(
            mine,
            x.old[keep] if x.old is not None else mine.detach(),
            x.ref[keep] if x.ref is not None else None,
            x.advantages[keep],
            x.weights[keep],
            x.rows[keep],
            self.clip,
            entropy,
        )
        return loss


@torch.no_grad()
def token_entropy(logits: torch.Tensor, vocab_size: int, tp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Each position's entropy [b, s] of the softmax of `logits` over the vocab (its padding left
    out); vocab-parallel logits (tp): the shards' maximum, normaliser and Σ p z added up over tp."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    local = logits.shape[-1]
    start = tp_mesh.get_local_rank() * local if tp > 1 else 0
    if start + local > vocab_size:
        cols = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    top = logits.amax(-1, keepdim=True)
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    shifted = logits - top
    e = shifted.exp()
    sums = torch.stack([e.sum(-1), torch.where(e > 0, e * shifted, 0.0).sum(-1)])
    if tp > 1:
        dist.all_reduce(sums, group=tp_mesh.get_group())
    return sums[0].log() - sums[1] / sums[0]


class TokenLogps(Loss):
    """Each microbatch's targets' log-probabilities at `temperature` [b, s] (0 where a target does
    not count), kept in `logps` by microbatch number; `rows()` them all in order."""

    fused = None

    def __init__(self, vocab_size: int, tp_mesh: DeviceMesh | None, temperature: float) -> None:
        super().__init__(vocab_size, tp_mesh)
        self.temperature = temperature
        self.logps: dict[int, torch.Tensor] = {}

    def count(self, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return torch.tensor(targets.shape[0], device=targets.device)

    def of_logits(self, mb: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        self.logps[mb.index] = self.token_logps(logits.float() / self.temperature, mb.targets).detach()
        return self.logps[mb.index].sum()

    def rows(self) -> torch.Tensor | None:
        """[rows, s], the microbatches' in order; None on a pipeline stage without the head."""
        return torch.cat([self.logps[i] for i in sorted(self.logps)]) if self.logps else None
