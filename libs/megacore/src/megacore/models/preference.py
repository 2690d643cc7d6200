"""Preference objectives over pairs of sequences: DPO (sigmoid, cDPO, IPO), SimPO and ORPO.

A preference batch holds pairs, each a chosen and a rejected sequence in adjacent rows. What an
objective needs of a row is the summed log-probability of its completion tokens under the policy
(`logps`), how many there are (`lengths`) and, for DPO, the same sum under the frozen reference
(`ref`). With h = (logps_c - ref_c) - (logps_r - ref_r), per pair:

- `dpo`, loss `sigmoid` (Rafailov et al. 2023, eq. 7), label smoothing ε (cDPO, Mitchell 2023):
  -(1 - ε) log σ(β h) - ε log σ(-β h)
- `dpo`, loss `ipo` (Azar et al. 2023, eq. 17): (h - 1 / (2β))², h of summed log-probabilities as
  the paper has it (TRL's `ipo` divides each sum by its length first)
- `simpo` (Meng et al. 2024, eq. 6), reference-free: -log σ(β (logps_c / |c| - logps_r / |r|) - γ)
- `orpo` (Hong et al. 2024, eqs. 6-7), reference-free: the chosen sequence's NLL per token plus
  β · -log σ(log odds(p_c) - log odds(p_r)), with log p = logps / |y| and log odds(p) = log p -
  log(1 - p) (TRL's ORPO averages its NLL over the batch's chosen tokens; here over each pair's,
  so that every objective is a mean over pairs)

The rewards logged under TRL's names (`rewards/chosen`, ...) are β (logps - ref) for DPO, and β
logps / |y| for the reference-free ones, whose `logps/*` are per token too (TRL's CPO and ORPO
trainers' conventions). Losses and metrics come back per pair, as sums to be divided by the pairs of
the whole batch: microbatches and data-parallel ranks add them up before the division. A pair whose
chosen side has no tokens is an empty slot of a packed row (`parallel.row_sums.RowSums`): its loss
and statistics are 0, and no gradient reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

ObjectiveType = Literal["lm", "dpo", "simpo", "orpo"]
# TRL's metric names, in the order `pair_metrics` sums them.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class Preference:
    """A preference objective's settings (the run manifest's `objective`, type not `lm`)."""

    type: Literal["dpo", "simpo", "orpo"]
    beta: float = 0.1
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # dpo only
    label_smoothing: float = 0.0  # dpo sigmoid only (cDPO)
    gamma: float = 0.5  # simpo's target margin

    @property
    def needs_reference(self) -> bool:
        return self.type == "dpo"


def pair_losses(
    obj: Preference,
    logps: torch.Tensor,
    lengths: torch.Tensor,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses [P] and statistics [P, 4] (the chosen and rejected rewards, then their log-
    probabilities as logged) of rows [2P] that alternate chosen and rejected: `logps` the policy's
    summed log-probabilities (with their gradient), `lengths` their completion tokens, `ref` the
    reference's sums (DPO); pairs of no tokens (empty slots) give zeros."""
    pair = lengths[0::2] > 0
    # An empty slot's stand-ins: any finite value with a finite gradient, which `where` then drops.
    pc, pr = (torch.where(pair, x, -1.0) for x in (logps[0::2], logps[1::2]))
    nc, nr = (torch.where(pair, n, 1).to(logps.dtype) for n in (lengths[0::2], lengths[1::2]))
    loss, stats = _pair_losses(obj, pc, pr, nc, nr, ref)
    return torch.where(pair, loss, 0.0), torch.where(pair[:, None], stats, 0.0)


def _pair_losses(
    obj: Preference,
    pc: torch.Tensor,
    pr: torch.Tensor,
    nc: torch.Tensor,
    nr: torch.Tensor,
    ref: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_losses` of pairs that all hold tokens."""
    beta = obj.beta
    if obj.type == "dpo":
        if ref is None:
            raise ValueError("DPO needs the reference's log-probabilities")
        ratio_c, ratio_r = pc - ref[0::2], pr - ref[1::2]
        h = ratio_c - ratio_r
        if obj.loss == "ipo":
            loss = (h - 1 / (2 * beta)) ** 2
        else:
            eps = obj.label_smoothing
            loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        return loss, torch.stack([beta * ratio_c, beta * ratio_r, pc, pr], 1).detach()
    mean_c, mean_r = pc / nc, pr / nr
    stats = torch.stack([beta * mean_c, beta * mean_r, mean_c, mean_r], 1).detach()
    if obj.type == "simpo":
        return -F.logsigmoid(beta * (mean_c - mean_r) - obj.gamma), stats
    # log odds(p) = log p - log(1 - p) for log p = the mean log-probability (< 0).
    log_odds = (mean_c - torch.log1p(-torch.exp(mean_c))) - (mean_r - torch.log1p(-torch.exp(mean_r)))
    return -mean_c - beta * F.logsigmoid(log_odds), stats


def pair_metrics(stats: torch.Tensor) -> torch.Tensor:
    """The sums over pairs of each of METRICS [len(METRICS)] from `pair_losses`' statistics
    [P, 4]: divided by the batch's pairs, TRL's means."""
    chosen, rejected = stats[:, 0], stats[:, 1]
    won = (chosen > rejected).to(stats.dtype)
    return torch.stack([chosen, rejected, won, chosen - rejected, stats[:, 2], stats[:, 3]], 1).sum(0)
