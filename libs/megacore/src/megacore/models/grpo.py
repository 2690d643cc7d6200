"""Group relative policy optimisation (GRPO) and its variants, over sampled completions: the
advantages of each group's rewards, and each completion token's loss.

A batch holds P prompts with G completions each (a group), N = P·G completions. A completion's
reward is the weighted sum of the reward functions' values, a function's None counting 0; one that
every function left None is unscorable: NaN, out of its group's mean and std, advantage 0 (TRL's
`sum_then_normalize`). Its advantage (`group_advantages`) is A_i = r_i − mean of its group,
divided by (std + 1e-4), the unbiased std of its group (`scale_rewards` group, GRPO: Shao et al.
2024), of the whole batch (batch), or not divided (none: Dr. GRPO, Liu et al. 2025).

Per completion token t of completion i, with log π (the policy being trained), log π_old (the
policy that sampled; log π itself, detached, when a batch of rollouts is used once:
`num_iterations` 1) and log π_ref (the reference, only when β > 0):

- the importance ratio ρ = exp(log π − log π_old), per token, or per completion (GSPO, Zheng et
  al. 2025, `importance_sampling_level` sequence): exp of the mean over i's tokens of that log ratio;
- ℓ_t = −min(ρ A_i, clip(ρ, 1 − ε, 1 + ε_high) A_i) + β ρ (π_ref/π − log(π_ref/π) − 1): PPO's
  clipped surrogate (ε_high > ε: DAPO's clip-higher, Yu et al. 2025) and the k3 estimator of
  KL(π‖π_ref) (Schulman 2020), weighted by ρ as TRL weights it by default
  (`use_bias_correction_kl`).

The batch's loss is Σ_t w_i ℓ_t, each completion's token weight w_i fixed once the completions are
known (`token_weights`): grpo 1 / (|o_i| N) (each completion's mean, then their mean); dapo and
bnpo 1 / T, T the batch's completion tokens (TRL's bnpo divides each process's micro batch by its
own tokens: the same with one process and no accumulation); dr_grpo 1 / (N L), L the
`max_completion_length`. With fixed weights the loss is a sum over tokens: microbatches and ranks
add their parts up as language modelling's do, and any layout gives the one-process loss.

Metrics are TRL's: `kl`, `entropy` (the policy's, at the token; given by the caller, who holds the
logits), `clip_ratio/low_mean` (ρ < 1 − ε where A < 0), `clip_ratio/high_mean`
(ρ > 1 + ε_high where A > 0), `clip_ratio/region_mean` (either), means over the batch's
completion tokens (over its completions with sequence-level ratios). `TokenStats` carries their
sums and what they divide by, to be added up over microbatches and ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dapo", "bnpo", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not a division by 0
STATS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CLIPS = 2  # where the clip ratios start in STATS


@dataclass(frozen=True)
class Clip:
    """The loss's settings: ε, ε_high, β and where the importance ratio is taken."""

    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    sequence_level: bool = False  # GSPO: one ratio per completion


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std of the values that are not NaN (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~x.isnan()).sum(dim) if dim is not None else (~x.isnan()).sum()
    var = torch.nansum((x - mean) ** 2, dim=dim) / (count - 1)
    return var.sqrt()


def group_advantages(
    values: torch.Tensor, weights: torch.Tensor, group: int, scale: ScaleRewards
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per completion (rows of `values`, N × functions, NaN where a function returned None; a group
    is `group` consecutive rows): its advantage, its reward (NaN when unscorable) and whether its
    group's (scale batch: the batch's) std is 0 (`frac_reward_zero_std`)."""
    unscorable = values.isnan().all(dim=1)
    rewards = (values * weights).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), rewards, zero_std


def token_weights(lengths: torch.Tensor, loss: LossType, max_completion_length: int) -> torch.Tensor:
    """Each completion's weight on every one of its tokens, from the batch's completion lengths
    (tokens counted in the loss: a masked completion's are 0)."""
    n = lengths.numel()
    if loss == "grpo":
        return torch.where(lengths > 0, 1.0 / (lengths.clamp(min=1) * n), 0.0).double()
    if loss == "dr_grpo":
        return torch.full((n,), 1.0 / (n * max_completion_length), dtype=torch.float64)
    return torch.full((n,), 1.0 / max(int(lengths.sum()), 1), dtype=torch.float64)


@dataclass
class TokenStats:
    """The metrics' sums (STATS' order) and what each divides by once they are added up over the
    batch: its completion tokens, or its completions for the clip ratios of sequence-level ratios."""

    sums: torch.Tensor
    counts: torch.Tensor


def token_losses(
    logps: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    completion: torch.Tensor,
    clip: Clip,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """Σ_t w ℓ_t over a microbatch's completion tokens, and the metrics' sums. Every argument is per
    token, flat: the policy's log-probability of the token, the sampling policy's and the
    reference's (None: β = 0), its completion's advantage and weight, and its completion's index in
    the microbatch (`completion`, for sequence-level ratios); `entropy`, the policy's at each
    token, for its metric (None: 0)."""
    log_ratio = logps - old
    if clip.sequence_level:
        n = int(completion.max()) + 1 if completion.numel() else 0
        ones = torch.ones_like(log_ratio)
        size = torch.zeros(n, dtype=log_ratio.dtype, device=logps.device).index_add_(0, completion, ones)
        total = torch.zeros_like(size).index_add_(0, completion, log_ratio)
        log_ratio = (total / size)[completion]
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - clip.epsilon, 1 + clip.epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(per_token)
    if clip.beta:
        d = ref - logps
        kl = (torch.exp(d) - d - 1) * ratio
        per_token = per_token + clip.beta * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        low = (ratio < 1 - clip.epsilon) & (advantages < 0)
        high = (ratio > 1 + clip.epsilon_high) & (advantages > 0)
        ent = entropy.to(kl.dtype) if entropy is not None else torch.zeros_like(kl)
        flags = torch.stack(
            [kl.detach(), ent, low.to(kl.dtype), high.to(kl.dtype), (low | high).to(kl.dtype)]
        )
        stats = _stats(flags, completion, clip.sequence_level)
    return loss, stats


def _stats(flags: torch.Tensor, completion: torch.Tensor, sequence_level: bool) -> TokenStats:
    """The metrics' sums over tokens; with sequence-level ratios the clip flags are a completion's,
    counted once (on its first token), as TRL's means over completions are."""
    sums = flags.double().sum(dim=1)
    tokens = float(flags.shape[1])
    counts = torch.full((len(STATS),), tokens, dtype=torch.float64, device=flags.device)
    if sequence_level and flags.shape[1]:
        first = torch.ones_like(completion, dtype=torch.bool)
        first[1:] = completion[1:] != completion[:-1]
        sums[CLIPS:] = flags[CLIPS:, first].double().sum(dim=1)
        counts[CLIPS:] = first.sum()
    return TokenStats(sums, counts)
