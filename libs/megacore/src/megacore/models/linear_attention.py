"""Gated DeltaNet, the linear attention of Qwen 3.5's and Qwen3-Next's "linear_attention" layers
(`config.linear_attention`, a `GatedDeltaNetSpec`): a layer of the one decoder in place of softmax
attention, with the same call (`Block` passes it the RoPE tables, which it does not use).

The input is projected to q, k (`key_heads` heads), v (`value_heads`), a gate z (v's width), the
write strength b and the decay input a (one per v head). q, k and v each pass a causal depthwise
convolution (`conv_kernel` taps) and SiLU; the gated delta rule (`models.delta_rule`) reads and
writes each head's state with beta = sigmoid(b) and log decay g = -exp(a_log) softplus(a + dt_bias);
its output is RMS-normed per head (a plain scale, not Gemma's 1 + w: the Qwen models' zero-centred
norms are the rest), times SiLU(z), and projected back. Rounding follows transformers'
Qwen3_5GatedDeltaNet: the convolution in the weights' dtype, the rule in fp32, the norm's product
rounded, the gate's in fp32.

Packed documents (`segments`) reset both the convolution's window and the state at each document's
start. With a cache (`models.kv_cache`), the convolution reads the cached inputs before the new
tokens and the rule starts from the cached state, so generation continues a row one token at a
time. Tensor parallel splits every projection and per-head tensor by heads (`parts.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacore.config import ModelConfig
from megacore.models.delta_rule import gated_delta_rule
from megacore.models.kv_cache import KVCache
from megacore.models.layers import FastPaths, HeadWeights, RMSNorm, project


class GatedDeltaNet(nn.Module):
    """Layer `layer`'s Gated DeltaNet; its tensors as `parts.linear.tensors` lists them."""

    local_rope = False  # no RoPE: the Decoder makes no tables for it

    def __init__(
        self,
        config: ModelConfig,
        layer: int = 0,
        impl: str = "auto",
        recompute: bool = False,
        fast: FastPaths = FastPaths(),
    ) -> None:
        super().__init__()
        spec, hidden = config.linear_attention, config.hidden_size
        self.layer, self.fused = layer, fast.projections
        self.key_dim, self.value_dim = spec.key_head_dim, spec.value_head_dim
        keys, values = spec.key_heads * spec.key_head_dim, spec.value_heads * spec.value_head_dim
        self.q_proj = nn.Linear(hidden, keys, bias=False)
        self.k_proj = nn.Linear(hidden, keys, bias=False)
        self.v_proj = nn.Linear(hidden, values, bias=False)
        self.z_proj = nn.Linear(hidden, values, bias=False)
        self.b_proj = nn.Linear(hidden, spec.value_heads, bias=False)
        self.a_proj = nn.Linear(hidden, spec.value_heads, bias=False)
        self.q_conv = HeadWeights(keys, 1, spec.conv_kernel)
        self.k_conv = HeadWeights(keys, 1, spec.conv_kernel)
        self.v_conv = HeadWeights(values, 1, spec.conv_kernel)
        self.dt_bias = HeadWeights(spec.value_heads)
        self.a_log = HeadWeights(spec.value_heads)
        self.norm = RMSNorm(spec.value_head_dim, config.norm.eps, fast.head_norms)
        self.o_proj = nn.Linear(values, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        linears = (self.q_proj, self.k_proj, self.v_proj, self.z_proj, self.b_proj, self.a_proj)
        q, k, v, z, write, a = project(x, *linears, fused=self.fused and cache is None)
        q, k, v = self._convolve((q, k, v), segments, cache)
        q, k = q.view(b, s, -1, self.key_dim), k.view(b, s, -1, self.key_dim)
        v = v.view(b, s, -1, self.value_dim)
        g = -self.a_log().float().exp() * F.softplus(a.float() + self.dt_bias())
        state = None if cache is None else cache.state(self.layer)
        out, state = gated_delta_rule(q, k, v, g, write.sigmoid(), segments, state)
        if cache is not None:
            cache.keep(self.layer, state)
        gate = F.silu(z.view(b, s, -1, self.value_dim).float())
        out = (self.norm(out).float() * gate).to(x.dtype)
        return self.o_proj(out.reshape(b, s, -1))

    def _convolve(
        self, streams: tuple[torch.Tensor, ...], segments: torch.Tensor | None, cache: KVCache | None
    ) -> tuple[torch.Tensor, ...]:
        """SiLU of each stream's causal convolution; with a cache over the inputs it holds before
        them too (the last conv_kernel - 1 positions, of their documents: `cache.keys`)."""
        filters = (self.q_conv(), self.k_conv(), self.v_conv())
        s = streams[0].shape[1]
        if cache is not None:
            streams = cache.update(self.layer, *streams)
            window = min(streams[0].shape[1], s + filters[0].shape[-1] - 1)
            streams = tuple(t[:, -window:] for t in streams)
            segments = None if cache.keys is None else cache.keys[:, -window:]
        out = (F.silu(causal_conv(t, w, segments)) for t, w in zip(streams, filters, strict=True))
        return tuple(t[:, -s:] for t in out)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of x [B, S, C] by weight [C, 1, K] (its last tap on the token
    itself, as nn.Conv1d with K - 1 zeros of left padding), computed in the weight's dtype and
    returned in x's; with `segments` [B, S] no tap reaches into an earlier document."""
    taps, dtype = weight.shape[-1], x.dtype
    x = x.to(weight.dtype)
    if segments is None:
        out = F.conv1d(x.transpose(1, 2), weight, padding=taps - 1, groups=x.shape[-1])
        return out[..., : x.shape[1]].transpose(1, 2).to(dtype)
    out = x * weight[:, 0, -1]
    for shift in range(1, min(taps, x.shape[1])):
        same = F.pad(segments[:, shift:] == segments[:, :-shift], (shift, 0))
        earlier = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        out = out + earlier * weight[:, 0, -1 - shift] * same[..., None]
    return out.to(dtype)
