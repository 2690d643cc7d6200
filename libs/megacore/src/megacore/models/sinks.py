"""Attention with sinks (gpt-oss): a learned logit per head in every softmax's denominator, whose
value is zero, so a query may put part of its attention on nothing.

With a kernel's output o and log-sum-exp l over the real keys, the sink s of the head gives
l' = logaddexp(l, s) and o' = o · exp(l − l'): one rescale after any attention kernel that returns
its log-sum-exp. Backward is the kernel's own backward given (o', l') in place of (o, l) — its
probabilities exp(scores − l') are then those of the softmax with the sink, and its row term
rowsum(do ∘ o') the sink's too — and the sink's gradient is −Σ exp(s − l') · rowsum(do ∘ o') over
the head's queries. On a CPU the kernel is SDPA's FlashAttention for CPU, whose forward gives the
log-sum-exp and whose backward takes it (a mask as an additive bias); elsewhere (a GPU) the
softmax over the scores with the sink as one more column, in fp32, through autograd: correct, with
an S x S score matrix per head. `sink_attention` takes q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (GQA
from the shapes) and a boolean mask [B or 1, 1, Sq, Sk] of the visible keys.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax([q k^T · scale + mask, sink]) without the sink's column, times v: [B, Sq, Hq, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cpu":
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return _CpuSinkAttention.apply(q, k, v, sinks, bias, scale)
    return _math_sink_attention(q, k, v, sinks, mask, scale)


def _math_sink_attention(q, k, v, sinks, mask, scale: float) -> torch.Tensor:
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:  # GQA: each q head's group's k/v
        kt, vt = (t.repeat_interleave(qt.shape[1] // t.shape[1], dim=1) for t in (kt, vt))
    scores = (qt.float() @ kt.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ vt).transpose(1, 2)


class _CpuSinkAttention(torch.autograd.Function):
    """The CPU FlashAttention kernel with the sinks' rescale (the module docstring's algebra)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bias, scale: float) -> torch.Tensor:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, False, attn_mask=bias, scale=scale
        )
        lse_s = torch.logaddexp(lse, sinks.float()[None, :, None])  # [B, H, Sq], fp32
        out_s = out * torch.exp(lse - lse_s).unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(qt, kt, vt, sinks, bias, out_s, lse_s)
        ctx.scale = scale
        return out_s.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qt, kt, vt, sinks, bias, out_s, lse_s = ctx.saved_tensors
        gt = grad.transpose(1, 2)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gt, qt, kt, vt, out_s, lse_s, 0.0, False, attn_mask=bias, scale=ctx.scale
        )
        rows = (gt.float() * out_s.float()).sum(-1)  # [B, H, Sq]
        dsinks = -(torch.exp(sinks.float()[None, :, None] - lse_s) * rows).sum((0, 2))
        grads = (t.transpose(1, 2) for t in (dq, dk, dv))
        return *grads, dsinks.to(sinks.dtype), None, None
