"""Next-token cross entropy fused with the output projection, computed in chunks of tokens.

The usual path materialises logits [N, V] in the compute dtype, upcasts them to fp32, and keeps
log-softmax outputs for backward: several full passes over the largest tensor of the step. Here each
chunk's logits are turned into their gradient right away (softmax minus one-hot, fp32 math, rounded
once to the compute dtype) and the input and weight gradients are computed in the same forward, so
backward only scales them. Same loss and gradients as `F.cross_entropy(logits.float(), targets)`
(up to float rounding); vocab padding columns (>= `vocab_size`) get no probability mass.
"""

from __future__ import annotations

import torch

# Tokens per chunk: logits stay under 64M fp32 elements whatever the vocab size, while chunks keep
# enough rows for the matmuls to run near full speed (bf16 AMX kernels slow down below ~1k rows).
_CHUNK_ELEMENTS = 1 << 26


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Mean cross entropy of `hidden @ weight.T` (hidden [..., H], weight [V_padded, H]) at `targets`."""
    return _FusedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), vocab_size)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
        n, v = h.shape[0], w.shape[0]
        chunk = max(1, min(n, _CHUNK_ELEMENTS // v))
        scale = 1.0 / n
        grad_h, grad_w = torch.empty_like(h), None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, tc = h[start : start + chunk], t[start : start + chunk, None]
            logits = hc @ w.T
            if v > vocab_size:
                logits[:, vocab_size:] = float("-inf")
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            target_logp = logp.gather(1, tc)
            total -= target_logp.sum()
            # d loss / d logits = (softmax - onehot) / n, rounded once to the compute dtype.
            probs = logp.exp_().mul_(scale)
            probs.scatter_(1, tc, target_logp.exp().sub_(1).mul_(scale))
            g = probs.to(h.dtype)
            torch.mm(g, w, out=grad_h[start : start + chunk])
            grad_w = g.T @ hc if grad_w is None else grad_w.addmm_(g.T, hc)
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        if not torch.equal(grad, torch.ones_like(grad)):
            grad_h, grad_w = grad_h * grad.to(grad_h.dtype), grad_w * grad.to(grad_w.dtype)
        return grad_h, grad_w, None, None
