"""LoRA's adapter dropout (`megacore.models.lora`): PEFT's semantics (each adapter its own mask on
its input, the kept elements scaled by 1 / (1 - p), nothing dropped in eval mode), checked against
the binomial distribution and worked-out values, through identity adapters that show the mask."""

from __future__ import annotations

import math

import torch
from torch import nn

from megacore.models.lora import add_lora, delta, dropout_p

N = 1 << 16  # elements per draw


def identity_adapters(p: float, linears: int = 2) -> nn.Module:
    """`linears` linears of width 256 whose adapters are identities (rank 256, scale 1): their
    delta is the dropped, rescaled input itself."""
    model = nn.ModuleDict({f"l{i}": nn.Linear(256, 256, bias=False) for i in range(linears)})
    add_lora(model, list(model), rank=256, scale=1.0, dropout=p)
    with torch.no_grad():
        for lin in model.values():
            lin.lora_A.weight.copy_(torch.eye(256))
            lin.lora_B.weight.copy_(torch.eye(256))
    return model


def test_the_probability_is_p_to_a_65536th() -> None:
    assert dropout_p(0.05) == 3277 / 65536
    assert dropout_p(0.1) == 6554 / 65536
    assert dropout_p(0.0) == 0.0


def test_each_adapter_drops_p_of_its_input_and_scales_the_rest() -> None:
    """Ones in: each adapter's output is 0 or 1 / (1 - p) (to fp32), the zeros' share within 5
    standard deviations of p's binomial, the two adapters' masks independent (their overlap within
    5 sigma of p²), the gradient reaching the input the same mask and scale."""
    torch.manual_seed(0)
    p = 0.1
    q = dropout_p(p)
    model = identity_adapters(p)
    x = torch.ones(N // 256, 256, requires_grad=True)
    outs = [delta(lin, x) for lin in model.values()]
    sigma = math.sqrt(q * (1 - q) / N)
    for out in outs:
        kept = out != 0
        assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - q)), rtol=1e-6)
        assert abs((~kept).float().mean().item() - q) < 5 * sigma
    both = ((outs[0] == 0) & (outs[1] == 0)).float().mean().item()
    assert abs(both - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / N)
    outs[0].sum().backward()
    assert torch.equal(x.grad, outs[0].detach())  # d(sum(x * m / (1-q)))/dx = m / (1-q)


def test_eval_mode_and_zero_p_drop_nothing() -> None:
    x = torch.randn(64, 256)
    model = identity_adapters(0.5).eval()
    assert torch.allclose(delta(model["l0"], x), x)
    assert torch.allclose(delta(identity_adapters(0.0)["l0"], x), x)
