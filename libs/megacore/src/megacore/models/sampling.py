"""Completions from a `Decoder` with a KV cache (`models.kv_cache`): the prompts' prefill in one
forward, then one token a step, each step's forward over the new tokens only.

`Sampling` says how a next token is chosen: greedy (temperature 0), or drawn from the softmax of
the logits / temperature, kept to the `top_k` most likely and the smallest set whose probability
reaches `top_p` (transformers' order and rules: temperature, then top-k, then top-p, the most
likely token always kept). Each row draws from a `torch.Generator` of its own, on the host, seeded
`seed` + its index or the seed its caller gives it: a row's completion depends on its seed and its
prompt, not on the rows beside it, so a run's completions are the same every time, on every rank,
and however its rows are split over data-parallel ranks. A row stops after a `stop_ids` token or
`max_new` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from megacore.models.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[B, V] fp32 logits / temperature, those top-k and top-p leave out set to -inf."""
    out = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < out.shape[-1]:
        kth = out.topk(sampling.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = out.sort(dim=-1)  # ascending: the tail first
        tail = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        tail[..., -1] = False  # the most likely token always stays
        out = out.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    return out


def next_tokens(
    logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """[B] the next token of each row from its logits [B, V], drawn with its row's generator."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, sampling).softmax(dim=-1).cpu()
    drawn = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(drawn).to(logits.device)


# The logits [B, vocab] of each row's next token after new ids [B, s] (on the model's device) and what
# the cache holds of the rows, or None on a rank that draws no tokens (a pipeline's earlier stages).
Forward = Callable[[torch.Tensor, KVCache], torch.Tensor | None]


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    sampling: Sampling = Sampling(),
    stop_ids: Collection[int] = (),
    pad_id: int = 0,
    done: Callable[[int, list[int]], bool] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """Each prompt's completion (module docstring) from a whole `Decoder` (its `cache` keyword):
    up to `max_new` ids, its stop id included, or up to where `done(row, ids so far)` says; row i
    draws from `seeds[i]` (None: the sampling's seed + i)."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    return decode(
        lambda ids, cache: model(ids, cache=cache)[:, -1, :vocab], prompts, max_new, device,
        sampling, stop_ids, pad_id, done, seeds,
    )  # fmt: skip


@torch.no_grad()
def decode(
    forward: Forward,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    device: torch.device,
    sampling: Sampling = Sampling(),
    stop_ids: Collection[int] = (),
    pad_id: int = 0,
    done: Callable[[int, list[int]], bool] | None = None,
    seeds: Sequence[int] | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] = lambda chosen: chosen,
) -> list[list[int]]:
    """`sample` over any `forward` (a model in a layout: `parallel.sampler`): the prompts left-padded
    into one cache, advanced once a forward, however many parts ran it; `agree(chosen)`: the tokens
    [B] every rank goes on with, the drawing rank's (a rank whose forward gave None holds
    placeholders). The logits past the vocab are never chosen (`forward` leaves them out)."""
    if not prompts or max_new < 1:
        return [[] for _ in prompts]
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
    starts = torch.tensor([longest - len(p) for p in prompts], device=device)
    cache = KVCache(longest + max_new, starts if int(starts.max()) > 0 else None)
    seeds = seeds if seeds is not None else [sampling.seed + i for i in range(len(prompts))]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    logits, new = forward(ids.to(device), cache), ids
    out: list[list[int]] = [[] for _ in prompts]
    running = torch.ones(len(prompts), dtype=torch.bool)
    for step in range(max_new):
        cache.advance(new.shape[1])
        if logits is not None:
            chosen = next_tokens(logits, sampling, generators)
        else:  # a placeholder: `agree` hands this rank the drawing rank's
            chosen = torch.zeros(len(prompts), dtype=torch.long, device=device)
        chosen = agree(chosen).cpu()
        for i in running.nonzero().flatten().tolist():
            out[i].append(int(chosen[i]))
            running[i] = int(chosen[i]) not in stop_ids and not (done is not None and done(i, out[i]))
        if step == max_new - 1 or not running.any():  # no forward whose logits nobody reads
            break
        new = chosen[:, None]
        logits = forward(new.to(device), cache)
    return out
