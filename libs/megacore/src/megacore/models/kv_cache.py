"""What each attention layer has seen of a batch of rows, for generating one token at a time
(`models.sampling`): a forward over new tokens appends their keys and values (standard attention)
or their normed latent and rotated k (latent attention, which expands k and v from it each step:
the latent is what it caches) and attends over everything so far; a linear attention layer appends
its convolution's inputs and keeps its recurrent state (`state`, `keep`).

Rows of different lengths are padded on the left, so that every row's next token is at the same
place: `starts` [B] is each row's first real token; its keys before it are left out of attention
(as document ids: 0 the padding, 1 the row), and its positions count from it, as transformers'
generate numbers left-padded rows.
"""

from __future__ import annotations

import torch


class KVCache:
    """Up to `capacity` positions of `rows` rows; every layer's buffers are made on first use, in the
    dtype and device of what it appends."""

    def __init__(self, capacity: int, starts: torch.Tensor | None = None) -> None:
        self.capacity, self.starts, self.length = capacity, starts, 0
        self.buffers: dict[int, list[torch.Tensor]] = {}
        self.states: dict[int, torch.Tensor] = {}  # linear attention's, by layer
        # Every key's document id (padding 0, the row 1) during a forward over new tokens, once for
        # all layers (`start`); None: no row is padded.
        self.keys: torch.Tensor | None = None

    def start(self, s: int) -> torch.Tensor | None:
        """A forward over s new tokens begins: the keys' document ids set for every layer, and the
        new tokens' returned (their queries', None: no row is padded)."""
        self.keys = self.segments(0, self.length + s)
        return self.segments(self.length, self.length + s)

    def update(self, layer: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`new` ([B, s, ...] each) appended after what layer `layer` holds; everything so far."""
        end = self.length + new[0].shape[1]
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {end} asked")
        if layer not in self.buffers:
            self.buffers[layer] = [t.new_zeros(t.shape[0], self.capacity, *t.shape[2:]) for t in new]
        held = self.buffers[layer]
        for buf, t in zip(held, new, strict=True):
            buf[:, self.length : end] = t
        return tuple(buf[:, :end] for buf in held)

    def state(self, layer: int) -> torch.Tensor | None:
        """Linear attention layer `layer`'s recurrent state after what the cache holds (None: none yet)."""
        return self.states.get(layer)

    def keep(self, layer: int, state: torch.Tensor) -> None:
        """Layer `layer`'s recurrent state after the tokens of this forward."""
        self.states[layer] = state

    def segments(self, start: int, end: int) -> torch.Tensor | None:
        """[B, end - start] of positions start..end: 0 for a row's left padding, 1 for the row (None:
        no row is padded)."""
        if self.starts is None:
            return None
        at = torch.arange(start, end, device=self.starts.device)
        return (at[None, :] >= self.starts[:, None]).long()

    def positions(self, s: int, rows: int, device: torch.device) -> torch.Tensor:
        """[rows, s] the RoPE positions of the next s tokens: counted from each row's first real one."""
        at = torch.arange(self.length, self.length + s, device=device)[None, :].expand(rows, s)
        return at if self.starts is None else (at - self.starts.to(device)[:, None]).clamp(min=0)

    def advance(self, s: int) -> None:
        """The forward over s new tokens is done: every layer holds them."""
        self.length += s
