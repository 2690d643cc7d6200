"""megacore's hand-written autograd functions against plain autograd: forward + backward time.

Each hand-written function is timed against the plain-autograd code it replaces, same inputs, same
dtype, fp32 and bf16, on the CPU with 2 threads:
- RMSNorm: `megacore.models.layers.RMSNorm` (fused: `_RMSNormFn`'s hand-written backward) against
  the same module with `fused = False` (nn.RMSNorm's own path), against `F.rms_norm` called
  directly (the op nn.RMSNorm calls), and against the composite transformers' LlamaRMSNorm writes
  (fp32 pow/mean/rsqrt, rounded, times the weight: the rounding ours reproduces);
- RoPE: `megacore.models.rope.apply_rope` (`_Rope`) against `x * cos + rotate_half(x) * sin`,
  tables from `rope_tables`; x is [1, tokens, 32 heads, 128];
- fused loss: `megacore.models.loss.fused_linear_cross_entropy` (`_FusedLinearCE`) against
  `F.cross_entropy(F.linear(h, w).float(), t)`, vocab 32000; and the same two in evaluation
  (forward only, under `torch.no_grad`: the fused loss then computes the loss alone).
Sizes: Llama-7B-like hidden 4096 with 4096 tokens (the loss: 2048 tokens, its matmuls dominate);
`--quick`: hidden 1024, 1024 tokens (loss 256), to check the benchmark runs.
A sample is forward + backward (`torch.autograd.grad` of the output with a fixed output gradient,
so nothing accumulates) called enough times in a row to last about 0.2 s (`--quick`: 0.05 s). Each
side runs one warm-up sample, then in every round each side runs one sample, the order rotated
every round (benchlib's `paired_rounds`); the ratio is the median over rounds of peer time / ours
in the same round (> 1: the hand-written one is faster), the times shown are each side's best.
Before timing, the outputs and gradients of both sides are checked to agree (relative to their
largest value: 1e-4 in fp32, 2e-2 in bf16), else the benchmark fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchlib import THREADS, main, median_ratio, paired_rounds
from run import Row

VOCAB = 32000
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
Step = Callable[[], tuple[torch.Tensor, ...]]  # forward + backward: (output, *input grads)


@dataclass
class Sizes:
    hidden: int
    tokens: int
    loss_tokens: int
    rounds: int
    loss_rounds: int
    sample_s: float  # how long one timed sample lasts at least

    @property
    def heads(self) -> int:
        return self.hidden // 128


FULL = Sizes(hidden=4096, tokens=4096, loss_tokens=2048, rounds=9, loss_rounds=5, sample_s=0.2)
QUICK = Sizes(hidden=1024, tokens=1024, loss_tokens=256, rounds=3, loss_rounds=3, sample_s=0.05)


def _step(forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...], grad_out) -> Step:
    """forward + backward of `forward()` into `inputs`, with a fixed output gradient."""

    def step() -> tuple[torch.Tensor, ...]:
        out = forward()
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    return step


def rmsnorm_cases(s: Sizes, dtype: torch.dtype) -> tuple[Step, dict[str, Step]]:
    from megacore.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    eps = 1e-5
    x = torch.randn(s.tokens, s.hidden, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(s.tokens, s.hidden, generator=g).to(dtype)
    fused = RMSNorm(s.hidden, eps=eps).to(dtype)
    with torch.no_grad():
        fused.weight.copy_(1 + 0.1 * torch.randn(s.hidden, generator=g))
    plain = RMSNorm(s.hidden, eps=eps, fused=False).to(dtype)  # nn.RMSNorm.forward
    plain.load_state_dict(fused.state_dict())
    w = plain.weight

    def llama() -> torch.Tensor:  # transformers' LlamaRMSNorm.forward
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    return _step(lambda: fused(x), (x, fused.weight), grad), {
        "nn.RMSNorm (fused=False)": _step(lambda: plain(x), (x, w), grad),
        "F.rms_norm": _step(lambda: F.rms_norm(x, (s.hidden,), w, eps), (x, w), grad),
        "LlamaRMSNorm composite": _step(llama, (x, w), grad),
    }


def rope_cases(s: Sizes, dtype: torch.dtype) -> tuple[Step, dict[str, Step]]:
    from megacore.config import ModelConfig
    from megacore.models.rope import apply_rope, rope_tables

    cfg = ModelConfig(
        family="llama", vocab_size=VOCAB, hidden_size=s.hidden, num_layers=1, num_heads=s.heads,
        num_kv_heads=s.heads, ffn_hidden_size=4 * s.hidden,
    )  # fmt: skip
    cos, sin = rope_tables(cfg, s.tokens, "cpu", dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, s.tokens, s.heads, cfg.head_dim, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=g).to(dtype)
    h = cfg.head_dim // 2

    def composite() -> torch.Tensor:  # transformers' apply_rotary_pos_emb
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    return _step(lambda: apply_rope(x, cos, sin), (x,), grad), {
        "x*cos + rotate_half(x)*sin": _step(composite, (x,), grad)
    }


def loss_cases(s: Sizes, dtype: torch.dtype) -> tuple[Step, dict[str, Step]]:
    from megacore.models.loss import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(s.loss_tokens, s.hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, s.hidden, generator=g) * s.hidden**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, VOCAB, (s.loss_tokens,), generator=g)
    one = torch.ones((), dtype=torch.float32)
    return _step(lambda: fused_linear_cross_entropy(h, w, t, VOCAB), (h, w), one), {
        "F.cross_entropy(F.linear(h, w).float(), t)": _step(
            lambda: F.cross_entropy(F.linear(h, w).float(), t), (h, w), one
        )
    }


def eval_loss_cases(s: Sizes, dtype: torch.dtype) -> tuple[Step, dict[str, Step]]:
    """The fused loss in evaluation (no autograd): the loss alone, no gradient matmuls."""
    from megacore.models.loss import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(s.loss_tokens, s.hidden, generator=g).to(dtype)
    w = (torch.randn(VOCAB, s.hidden, generator=g) * s.hidden**-0.5).to(dtype)
    t = torch.randint(0, VOCAB, (s.loss_tokens,), generator=g)

    def no_grad(f: Callable[[], torch.Tensor]) -> Step:
        def step() -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                return (f(),)

        return step

    return no_grad(lambda: fused_linear_cross_entropy(h, w, t, VOCAB)), {
        "F.cross_entropy(F.linear(h, w).float(), t)": no_grad(
            lambda: F.cross_entropy(F.linear(h, w).float(), t)
        )
    }


def max_rel_error(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """Largest |a - b| over each tensor's largest |b|, over the output and every gradient."""
    with torch.no_grad():
        return max(
            float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
            for x, y in zip(a, b, strict=True)
        )


def sample(step: Step, calls: int) -> float:
    """Seconds per call of `calls` forward + backward calls in a row."""
    t = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t) / calls


def timed_rounds(steps: dict[str, Step], rounds: int, sample_s: float) -> dict[str, list[float]]:
    """One call of each side (which sets how many calls a sample makes, the same for all sides),
    one warm-up sample of each, then `rounds` paired rounds of one sample each, the order rotated."""
    once = max(sample(step, 1) for step in steps.values())
    calls = max(1, round(sample_s / max(once, 1e-9)))
    return paired_rounds(steps, rounds, lambda k, _: sample(steps[k], calls), warmup=True, rotate=True)


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 0.1 else f"{t * 1e3:.0f} ms"


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(THREADS)
    s = QUICK if quick else FULL
    kernels = (
        ("RMSNorm", rmsnorm_cases, s.rounds, f"{s.tokens}x{s.hidden}"),
        ("RoPE", rope_cases, s.rounds, f"1x{s.tokens}x{s.heads}x128"),
        ("fused loss", loss_cases, s.loss_rounds, f"{s.loss_tokens}x{s.hidden}, vocab {VOCAB}"),
        ("fused loss (eval)", eval_loss_cases, s.loss_rounds, f"{s.loss_tokens}x{s.hidden}, vocab {VOCAB}"),
    )
    rows = []
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for kernel, build, rounds, shape in kernels:
            ours, peers = build(s, dtype)
            reference = ours()
            errors = {label: max_rel_error(reference, peer()) for label, peer in peers.items()}
            bad = {k: e for k, e in errors.items() if e > TOLERANCE[dtype]}
            if bad:
                raise RuntimeError(
                    f"{kernel} {dname}: results differ from {bad} (tolerance {TOLERANCE[dtype]})"
                )
            times = timed_rounds({"ours": ours, **peers}, rounds, s.sample_s)
            best = {k: min(v) for k, v in times.items()}
            for label in peers:
                ratio = median_ratio(times[label], times["ours"])
                rows.append(
                    Row("kernels", f"{kernel} {'fwd' if 'eval' in kernel else 'fwd+bwd'} {dname} vs {label}", _ms(best["ours"]),
                        _ms(best[label]), ratio, ">= 1x",
                        f"{shape}, {THREADS} threads; median of {rounds} paired rounds; best-of "
                        f"{best[label] / best['ours']:.2f}x; max rel err {errors[label]:.1e}")
                )  # fmt: skip
            del ours, peers, reference
    return rows


if __name__ == "__main__":
    main(run)
