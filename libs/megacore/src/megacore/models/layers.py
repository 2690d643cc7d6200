"""The pieces the decoder's attention and MLP modules are built of (`models.decoder`,
`models.linear_attention`): the norms with their hand-written backward, the q/k/v-style fused
projections, per-head weights as modules (what tensor parallel splits by heads), and the
single-device fast paths a model is built with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megacore.config import ModelConfig
from megacore.config_parts import PlusOneRMSNormSpec, RMSNormSpec
from megacore.models.lora import delta, has_adapter


@dataclass(frozen=True)
class FastPaths:
    """The single-device fast paths a Decoder is built with (each assumes whole plain tensors)."""

    norms: bool = True  # the hidden-size norms' hand-written backward
    head_norms: bool = True  # the per-head q/k norms' (qk_norm)
    projections: bool = True  # q/k/v and gate/up as one matmul each


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters and state dict) with a hand-written backward: one fp32 pass over
    the saved input instead of autograd through pow/mean/rsqrt/mul. `fused=False` (sequence
    parallel's DTensors) takes nn.RMSNorm's path.

    `bench/run.py kernels` (CPU, 2 threads, 4096 tokens x hidden 4096, two runs): forward+backward
    0.88-0.89x the time of nn.RMSNorm in fp32 (about the same against F.rms_norm and transformers'
    LlamaRMSNorm composite); in bf16 0.93-0.96x the time of nn.RMSNorm and 0.99-1.06x that of the
    composite. It pays in fp32, barely in bf16 (within the machine's noise)."""

    offset = 0.0  # the scale is offset + weight (`PlusOneRMSNorm`: 1)

    def __init__(self, dim: int, eps: float, fused: bool = True) -> None:
        super().__init__(dim, eps=eps)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps or torch.finfo(x.dtype).eps
        if torch.compiler.is_compiling():  # plain ops, which the compiler fuses on its own
            xf = x.float()
            return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * self.weight
        if not self.fused:
            return super().forward(x)
        return _RMSNormFn.apply(x, self.weight, eps, self.offset)


class PlusOneRMSNorm(RMSNorm):
    """Gemma's RMSNorm (norm "rmsnorm_plus1"): x / rms(x) · (1 + weight), the product taken in fp32
    and rounded once (transformers' Gemma3RMSNorm; Llama's rounds before the weight). Weights as
    Gemma stores them: 0 is the identity, and fresh ones are zeros. Its unfused path is plain ops,
    which DTensors (sequence parallel, per-head norms under tp) and the compiler take as they are."""

    offset = 1.0

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps or torch.finfo(x.dtype).eps
        if self.fused and not torch.compiler.is_compiling():
            return _RMSNormFn.apply(x, self.weight, eps, self.offset)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    """`RMSNorm`'s fused path (what the benchmark shows it saves: `RMSNorm`'s docstring); with
    `offset` 1, `PlusOneRMSNorm`'s (scale 1 + weight, in fp32, rounded once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        if offset:
            return (xf * rstd * (offset + weight.float())).to(x.dtype)  # rounding as Gemma3RMSNorm
        return (xf * rstd).to(x.dtype) * weight  # rounding as transformers' LlamaRMSNorm

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.float() * rstd, grad.float()
        gw = g * (weight.float() + ctx.offset) if ctx.offset else g * weight.float()
        grad_weight = (g * xhat).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        dot = (gw * xhat).mean(-1, keepdim=True)
        return ((gw - xhat * dot) * rstd).to(x.dtype), grad_weight, None, None


def project(x: torch.Tensor, *linears: nn.Linear, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """Each linear applied to x; `fused`: as one matmul over the concatenated weights (wider matmuls
    run faster, notably bf16 AMX kernels), the parameters staying separate."""
    if not fused:
        return tuple(lin(x) for lin in linears)
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    out = F.linear(x, torch.cat(weights), bias).split([w.shape[0] for w in weights], dim=-1)
    # LoRA adapters (their hooks run on module calls only, which this path makes none of)
    return tuple(o + delta(lin, x) if has_adapter(lin) else o for o, lin in zip(out, linears, strict=True))


def make_norm(config: ModelConfig, fast: FastPaths, head_dim: int | None = None) -> nn.Module:
    """The config's norm over the hidden size, or with `head_dim` a per-head q/k norm: an RMSNorm
    (Qwen 3's), of Gemma's kind (`PlusOneRMSNorm`) with rmsnorm_plus1."""
    dim = config.hidden_size if head_dim is None else head_dim
    fused = fast.norms if head_dim is None else fast.head_norms
    kind = config.norm
    if isinstance(kind, PlusOneRMSNormSpec):
        return PlusOneRMSNorm(dim, kind.eps, fused)
    if isinstance(kind, RMSNormSpec) or head_dim is not None:
        return RMSNorm(dim, kind.eps, fused)
    return nn.LayerNorm(dim, eps=kind.eps, bias=kind.bias)


class HeadWeights(nn.Module):
    """A tensor split on its first dim by heads, as a module, so tensor parallel can hand it this
    rank's heads' part, as it hands a projection its shard; calling it gives the tensor: attention
    sinks (gpt-oss: a logit per q head), linear attention's per-head decay parameters and its
    convolution's filters."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))

    def forward(self) -> torch.Tensor:
        return self.weight
