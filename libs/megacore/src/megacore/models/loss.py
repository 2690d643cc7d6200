"""Next-token cross entropy fused with the output projection, computed in chunks of tokens.

The usual path materialises logits [N, V] in the compute dtype, upcasts them to fp32, and keeps
log-softmax outputs for backward: several full passes over the largest tensor of the step, each in
freshly allocated memory. Here each chunk's logits go through reused fp32 scratch (log-softmax and
exp in place), turn into their gradient right away (softmax minus one-hot, rounded once to the
compute dtype), and the input and weight gradients are computed in the same forward, so backward only
scales them. Same loss and gradients as `F.cross_entropy(logits.float(), targets)` (up to float
rounding), targets equal to IGNORE (F.cross_entropy's ignore_index) included: they count for
nothing; vocab padding columns (>= `vocab_size`) get no probability mass.
"""

from __future__ import annotations

from typing import Literal

import torch

from megacore.config import LOSS_CHUNK_ELEMENTS
from megacore.data.packing import IGNORE  # a target that is not predicted (torch-free, beside the data)
from megacore.models.scratch import scratch

_CHUNK_ELEMENTS = LOSS_CHUNK_ELEMENTS  # a module global: tests shrink it to force many chunks


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    reduction: Literal["mean", "sum", "rows"] = "mean",
) -> torch.Tensor:
    """Cross entropy of `hidden @ weight.T` (hidden [..., H], weight [V_padded, H]) at `targets`: the
    mean or the sum over the targets that are not IGNORE (a mean over none is 0, with zero gradients),
    or `rows`: each row's sum [B] of hidden [B, S, H] (a preference objective's sequences).

    `bench/run.py kernels` (CPU, 2 threads, 2048 tokens x hidden 4096, vocab 32000, two runs):
    forward+backward 0.75-0.77x the time of `F.cross_entropy(F.linear(h, w).float(), t)` in bf16,
    0.76-0.96x in fp32 (the matmuls both share dominate there). It pays in both, most in bf16."""
    # Without autograd (evaluation) the gradient pieces would be thrown away: the loss alone.
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction == "rows":  # one autograd node per row, so each row's loss has a gradient of its own
        return torch.stack(
            [
                _FusedLinearCE.apply(h, weight, t, vocab_size, True, grads)
                for h, t in zip(hidden, targets, strict=True)
            ]
        )
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    return _FusedLinearCE.apply(h, weight, t, vocab_size, reduction == "sum", grads)


def _add_weight_grad(
    grad_w: torch.Tensor,
    acc: torch.Tensor | None,
    g: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    first: bool,
) -> None:
    """A chunk's part of the output layer's gradient, scale · gᵀ rows, added to `grad_w`, or with
    `acc` (a low-precision gradient's fp32 sum over the chunks) to `acc`. beta=0 ignores what grad_w
    holds: nothing yet, or (with acc) the previous chunk's part."""
    torch.addmm(grad_w, g.T, rows, beta=0 if first or acc is not None else 1, alpha=scale, out=grad_w)
    if acc is not None:
        acc.copy_(grad_w) if first else acc.add_(grad_w)


class _FusedLinearCE(torch.autograd.Function):
    """`fused_linear_cross_entropy`'s autograd function (benchmark figures in its docstring)."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab_size: int, summed: bool, grads: bool
    ) -> torch.Tensor:
        n, v = h.shape[0], w.shape[0]
        chunk = max(1, min(n, _CHUNK_ELEMENTS // v))
        # Ignored targets: gathered at 0, then their loss and their rows' part of both gradients
        # zeroed, on the device: a sum never asks how many count (a mean's scale does).
        keep = t != IGNORE
        t = t.masked_fill(~keep, 0)
        counted = None if summed else int(keep.sum())
        scale = 1.0 if summed else 1.0 / max(counted, 1)
        low_precision = h.dtype != torch.float32
        grad_h = torch.empty_like(h) if grads else None
        # A frozen output layer (LoRA's base) needs no gradient: not its vocab x hidden matmul either.
        grad_w = torch.empty_like(w) if grads and ctx.needs_input_grad[1] else None
        # Over several chunks a low-precision weight gradient is summed in fp32, then rounded once.
        acc = (
            torch.empty_like(w, dtype=torch.float32)
            if grad_w is not None and low_precision and n > chunk
            else None
        )
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, tc, kc = (
                h[start : start + chunk],
                t[start : start + chunk, None],
                keep[start : start + chunk, None],
            )
            logits = scratch("ce.logits", (hc.shape[0], v), torch.float32, h.device)
            if low_precision:  # matmul in the compute dtype, softmax in fp32
                low = scratch("ce.low", logits.shape, h.dtype, h.device)
                logits.copy_(torch.mm(hc, w.T, out=low))
            else:
                torch.mm(hc, w.T, out=logits)
            if v > vocab_size:
                logits[:, vocab_size:] = float("-inf")
            logp = torch.log_softmax(logits, 1, out=logits)
            target_logp = logp.gather(1, tc)
            total -= (target_logp * kc).sum()
            if not grads:
                continue
            gh = grad_h[start : start + chunk]
            # d loss / d logits = (softmax - onehot) * scale; the scale goes into the matmuls' alpha.
            g = logp.exp_().scatter_(1, tc, target_logp.exp().sub_(1))
            if low_precision:
                g = low.copy_(g)
            torch.addmm(gh, g, w, beta=0, alpha=scale, out=gh)
            gh.mul_(kc)  # an ignored row's input gradient: none
            if grad_w is not None:
                # An ignored row adds nothing to the weight's gradient: its input row taken as zeros
                # (hidden-wide, where zeroing its gradient row would be vocab-wide).
                _add_weight_grad(grad_w, acc, g, hc * kc, scale, first=start == 0)
        if acc is not None:
            grad_w.copy_(acc)
        if grads:
            ctx.save_for_backward(grad_h, grad_w)
        return total if summed else total / max(counted, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        # Always scaled: asking whether `grad` is 1 would read it back to the host (the engine's is
        # the step's weight anyway).
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad.to(grad_w.dtype)
        return grad_h * grad.to(grad_h.dtype), grad_w, None, None, None, None
