"""bf16 compute without data parallelism (`ComputeCopies`): the gradients are exactly those of the
model cast to bf16, accumulated over the microbatches in fp32, and each step computes with the
fp32 parameters' current values."""

from __future__ import annotations

import copy

import pytest
import torch

from megacore.config import ModelConfig
from megacore.models import Decoder
from megacore.parallel.engine import ComputeCopies, ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown

CONFIG = dict(
    family="llama", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=64, max_seq_len=16,
)  # fmt: skip
MICROBATCHES = 2


def reference_grads(model: Decoder, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """fp32 sums of the bf16 model's gradients of (summed loss / all targets), one microbatch at a
    time (what the engine computes), and the mean loss."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    acc: dict[str, torch.Tensor] = {}
    total = 0.0
    for x, y in zip(tokens.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
        low.zero_grad(set_to_none=True)
        loss = low(x, y, reduction="sum")
        (loss * (1.0 / targets.numel())).backward()
        total = total + loss.detach().float()
        for name, p in low.named_parameters():
            g = p.grad.float()
            acc[name] = g if name not in acc else acc[name] + g
    return acc, total / targets.numel()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bf16_without_dp_matches_the_cast_model_accumulated_in_fp32(tie: bool, monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a one-process group of its own
        monkeypatch.delenv(var, raising=False)
    config = ModelConfig(**CONFIG, tie_embeddings=tie)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, (4, 17), generator=g)
    tokens, targets = rows[:, :-1], rows[:, 1:]
    try:
        pm = ParallelModel(
            config,
            Parallelism(precision="bf16", microbatches=MICROBATCHES, attention="sdpa"),
            build_mesh(),
            "cpu",
        )
        assert len(pm.copies) == 1 and isinstance(pm.copies[0], ComputeCopies)
        pm.init_weights(seed=3)
        ref = Decoder(config, attention="sdpa")
        ref.init_weights(seed=3)
        names = [n for n, _ in pm.named_parameters()]
        assert names == [n for n, _ in ref.named_parameters()]
        assert all(p.dtype == torch.float32 for p in pm.parameters())
        assert all(p.dtype == torch.bfloat16 for p in pm.parts[0].parameters())

        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for step in range(2):  # the second step must see the first one's update
            want, want_loss = reference_grads(ref, tokens, targets)
            loss = pm.forward_backward(tokens, targets).loss
            assert torch.equal(loss, want_loss), f"step {step}: loss {loss} != {want_loss}"
            for name, p in pm.named_parameters():
                assert torch.equal(p.grad, want[name]), f"step {step}: gradient of {name}"
            assert all(p.grad is None for p in pm.parts[0].parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                ref.load_state_dict(dict(pm.named_parameters()))
        assert torch.equal(pm.evaluate(tokens, targets), reference_grads(ref, tokens, targets)[1])
    finally:
        shutdown()
