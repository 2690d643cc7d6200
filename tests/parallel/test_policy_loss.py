"""GRPO's loss on the engine (`PolicyLoss`): rows of prompt + sampled completion in two
microbatches, the completion's tokens the counted targets; the loss and every gradient equal the
formulas (`grpo_formulas`) over transformers' log-probabilities of the same model at the sampling
temperature (fp32, 1e-5), for a batch used once (old log-probabilities the policy's own) and a
batch's second use (old ones given) with β > 0 and sequence-level ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_formulas import completion_logps, formula_loss
from hf_cases import build, load_hf, ours_from_dir
from megacore.data.packing import IGNORE
from megacore.models import hf_state_dict_to_ours
from megacore.models.grpo import Clip, token_weights
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from megacore.parallel.policy_loss import PolicyInputs, PolicyLoss

PROMPT, MAXLEN, LENGTHS, TEMPERATURE = 3, 5, [5, 2, 4, 3], 0.7
CASES = {"once": ("dapo", Clip(), False), "second-use": ("grpo", Clip(beta=0.04, sequence_level=True), True)}


def _rows(per_token: torch.Tensor) -> torch.Tensor:
    """[N, MAXLEN] values of the completion tokens placed where the rows' targets predict them."""
    out = torch.zeros(len(LENGTHS), PROMPT + MAXLEN - 1, dtype=per_token.dtype)
    out[:, PROMPT - 1 :] = per_token
    return out


@pytest.mark.parametrize("case", [pytest.param("once", marks=pytest.mark.slow), "second-use"])
def test_the_engine_loss_equals_the_formulas(tmp_path: Path, monkeypatch, case: str) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a one-process group of its own
        monkeypatch.delenv(var, raising=False)
    loss_type, clip, given_old = CASES[case]
    hf_dir = build("llama", tmp_path / "hf")
    hf, ours = load_hf(hf_dir), ours_from_dir(hf_dir)
    g = torch.Generator().manual_seed(0)
    n, vocab = len(LENGTHS), ours.config.vocab_size
    prompt_ids = torch.randint(1, vocab, (n, PROMPT), generator=g)
    completion_ids = torch.randint(1, vocab, (n, MAXLEN), generator=g)
    mask = torch.arange(MAXLEN)[None] < torch.tensor(LENGTHS)[:, None]
    rows = torch.cat([prompt_ids, completion_ids], dim=1)
    targets = rows[:, 1:].clone()
    targets[:, : PROMPT - 1] = IGNORE
    targets[:, PROMPT - 1 :][~mask] = IGNORE
    with torch.no_grad():
        logps = completion_logps(hf, prompt_ids, completion_ids, TEMPERATURE)
    old = logps + 0.3 * torch.randn(logps.shape, generator=g) if given_old else logps
    ref = logps + 0.5 * torch.randn(logps.shape, generator=g)
    advantages = torch.tensor([0.9, -1.1, 0.4, -0.7])

    hf.zero_grad()
    want = formula_loss(completion_logps(hf, prompt_ids, completion_ids, TEMPERATURE), old, ref, advantages,
                        LENGTHS, loss_type, clip, MAXLEN)  # fmt: skip
    want.backward()
    want_grads = hf_state_dict_to_ours(ours.config, {k: p.grad for k, p in hf.named_parameters()})

    weights = token_weights(torch.tensor(LENGTHS), loss_type, MAXLEN).float() * n
    inputs = {
        k: PolicyInputs(
            old=_rows(old)[k * 2 : k * 2 + 2] if given_old else None,
            ref=_rows(ref)[k * 2 : k * 2 + 2] if clip.beta else None,
            advantages=advantages[k * 2 : k * 2 + 2, None].expand(2, PROMPT + MAXLEN - 1),
            weights=weights[k * 2 : k * 2 + 2, None].expand(2, PROMPT + MAXLEN - 1),
            rows=torch.arange(2)[:, None].expand(2, PROMPT + MAXLEN - 1),
        )
        for k in range(2)
    }
    try:
        pm = ParallelModel(ours.config, Parallelism(precision="fp32", microbatches=2, attention="sdpa"),
                           build_mesh(), "cpu")  # fmt: skip
        with torch.no_grad():
            state = ours.state_dict()
            for name, p in pm.named_parameters():
                p.copy_(state[name])
        loss = PolicyLoss(vocab, None, clip, TEMPERATURE, inputs)
        got = pm.forward_backward(rows[:, :-1], targets, count=n, loss=loss).loss
        assert torch.allclose(got, want.detach(), rtol=1e-5, atol=1e-7), (got, want)
        for name, p in pm.named_parameters():
            assert torch.allclose(p.grad, want_grads[name], rtol=1e-5, atol=1e-6), name
        assert sorted(loss.stats) == [0, 1]
    finally:
        shutdown()
