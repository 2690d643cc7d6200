"""Context parallelism: each sample's sequence spread over the `cp` ranks of the mesh's cp axis.

The split is balanced for the causal mask: the sequence is cut into 2 x cp chunks and cp rank r
holds chunks r and 2cp - 1 - r (one early, one late), so every rank does the same attention work.
Every token-wise part of the model (embedding, norms, MLP, the loss) runs on the rank's own
tokens unchanged; attention needs every earlier key, so its keys and values are all-gathered over
cp (only the kv heads travel: GQA's fewer heads mean less traffic), as Llama 3 was trained, and
their gradients are reduce-scattered back. Latent attention (DeepSeek V3) gathers what its k and v
are expanded from instead, the normed latent and the rotated k every head shares (576 values a
token at DeepSeek V3's size, against 128 heads x (192 + 128) of k and v), and each rank expands the
whole row's k and v itself. RoPE takes each token's global position; packed
documents' ids (segments) are those of the whole row, computed before the split.

Parameters are replicated over cp like over dp (the engine shards them with FSDP2 over dp x cp,
as torchtitan does), so checkpoints do not depend on cp.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megacore.models.attention import Impl, causal_attention, suffix_attention
from megacore.models.decoder import LatentAttention

# torch 2.13 renamed the collectives into a tensor (the old names warn); 2.11 (GPU machines) has the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_order(cp: int) -> list[int]:
    """The global chunk indices in the order the ranks hold them (rank 0's two, rank 1's, ...)."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


@functools.lru_cache(maxsize=16)
def local_indices(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions in the whole sequence of the tokens cp rank `rank` holds (cached: every
    forward of a run asks for the same)."""
    return shard_sequence(torch.arange(seq_len, device=device)[None], cp, rank)[0]


def shard_sequence(t: torch.Tensor | None, cp: int, rank: int) -> torch.Tensor | None:
    """This cp rank's tokens of `t` [B, S, ...] (dim 1): its early chunk, then its late one."""
    if t is None or cp == 1:
        return t
    halves = t.chunk(2 * cp, dim=1)
    return torch.cat([halves[rank], halves[2 * cp - 1 - rank]], dim=1)


def unshard_sequence(parts: torch.Tensor, cp: int) -> torch.Tensor:
    """The whole sequence from every rank's tokens gathered on dim 0, [cp * B, S / cp, ...] in rank
    order (an all-gather's), as [B, S, ...] in order."""
    b = parts.shape[0] // cp
    chunks = [half for part in parts.split(b) for half in part.chunk(2, dim=1)]
    held = chunk_order(cp)
    return torch.cat([chunks[held.index(c)] for c in range(2 * cp)], dim=1)


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every cp rank's `t` stacked on dim 0, in rank order."""
    t = t.contiguous()
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    _all_gather(out, t, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather over the cp group on dim 0; backward: reduce-scatter (sum) of the gradient, since
    every rank's queries used every rank's keys."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, group=ctx.group)
        return out, None


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """The whole sequence [B, S, ...] of a tensor every cp rank holds its tokens of, differentiable."""
    return unshard_sequence(_GatherSequence.apply(t, group), cp)


class ContextParallelAttention:
    """`causal_attention` for queries of this rank's tokens against the whole sequence's keys:
    the attention kernel of every layer under cp (`Attention.kernel`). Each of the rank's two
    chunks attends the keys up to its own end, causal aligned to the bottom right
    (`suffix_attention`: no mask on a GPU, nor on a CPU without windows or documents)."""

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        # The whole row's document ids, gathered once per forward: every layer gets the same
        # `segments` tensor (its identity is the key).
        self._segments: tuple[torch.Tensor, torch.Tensor] | None = None

    def _keys_segments(self, segments: torch.Tensor) -> torch.Tensor:
        if self._segments is None or self._segments[0] is not segments:
            self._segments = (segments, unshard_sequence(_gather(segments, self.group), self.cp))
        return self._segments[1]

    def whole_row(self, t: torch.Tensor) -> torch.Tensor:
        """The whole row [B, S, ...] of `t`, of which this rank holds its tokens (differentiable)."""
        return gather_sequence(t, self.group, self.cp)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest) -> torch.Tensor:
        """`attend` after gathering the whole row's k and v (`rest`: `attend`'s other arguments)."""
        return self.attend(q, self.whole_row(k), self.whole_row(v), *rest)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        impl: Impl = "auto",
        segments: torch.Tensor | None = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's queries against the whole row's keys and values k/v [B, S, heads, D]."""
        cp, n = self.cp, q.shape[1] // 2
        keys_segments = None if segments is None else self._keys_segments(segments)
        outs = []
        for half, chunk in enumerate((self.rank, 2 * cp - 1 - self.rank)):
            end, own = (chunk + 1) * n, slice(half * n, (half + 1) * n)
            seg = None if segments is None else segments[:, own]
            if chunk == 0:  # the first chunk is a sequence of its own: today's kernels
                outs.append(causal_attention(q[:, own], k[:, :n], v[:, :n], window, impl, seg, scale, sinks))
                continue
            kseg = None if segments is None else keys_segments[:, :end]
            outs.append(
                suffix_attention(q[:, own], k[:, :end], v[:, :end], window, impl, seg, kseg, scale, sinks)
            )
        return torch.cat(outs, dim=1)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallel over `cp_mesh` for a Decoder (or a pipeline stage of one), in place: every
    attention's kernel, and the RoPE tables of the whole sequence's length."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    kernel = ContextParallelAttention(cp_mesh.get_group(), cp, rank)
    model.sequence_shards = cp
    for block in model.layers.values():
        if isinstance(block.attn, LatentAttention):  # the latent travels, not the expanded k and v
            block.attn.kernel, block.attn.whole_row = kernel.attend, kernel.whole_row
        else:
            block.attn.kernel = kernel

    def positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # A row without packed documents: its tokens' places in the whole row. A DTensor input (a
        # later stage under sequence parallel) has the cp part's length as its shape.
        if kwargs.get("positions") is None:
            x = args[0]
            index = local_indices(x.shape[1] * cp, cp, rank, x.device)
            kwargs = {**kwargs, "positions": index.expand(x.shape[0], -1)}
        return args, kwargs

    model.register_forward_pre_hook(positions, with_kwargs=True)
