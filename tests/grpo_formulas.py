"""GRPO's loss written out from its formulas (`megacore.models.grpo`'s docstring), one completion and
one token at a time over a transformers model's log-probabilities: the reference the GRPO tests
compare the module, the engine's loss and the objective with."""

from __future__ import annotations

import torch

from megacore.models.grpo import Clip


def completion_logps(
    model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Each completion token's log-probability under `model` (transformers) with its logits over
    `temperature`, [N, completion length]; prompts all of one length."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(ids).logits[:, prompt_ids.shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]


def formula_loss(logps, old, ref, advantages, lengths: list[int], loss: str, clip: Clip, max_len: int):
    """The batch's loss: `logps`, `old`, `ref` [N, T] (a completion's first `lengths[i]` tokens
    count), `advantages` [N]."""
    n, total = len(lengths), sum(lengths)
    out = torch.zeros(())
    for i, length in enumerate(lengths):
        log_ratio = [logps[i, t] - old[i, t] for t in range(length)]
        if clip.sequence_level:
            log_ratio = [sum(log_ratio) / length] * length
        terms = []
        for t in range(length):
            rho = torch.exp(log_ratio[t])
            a = advantages[i]
            term = -torch.minimum(rho * a, rho.clamp(1 - clip.epsilon, 1 + clip.epsilon_high) * a)
            if clip.beta:
                d = ref[i, t] - logps[i, t]
                term = term + clip.beta * rho * (torch.exp(d) - d - 1)
            terms.append(term)
        s = sum(terms)
        out = out + {"grpo": s / length / n, "dr_grpo": s / (n * max_len)}.get(loss, s / total)
    return out
