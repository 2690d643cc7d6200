"""GRPO's advantages and per-token loss (`megacore.models.grpo`) against the formulas written out per
completion in plain PyTorch (loss and its gradient through a transformers Llama, fp32, 1e-5) and
against TRL 1.16's `GRPOTrainer._compute_loss` handed the same completions (loss and metrics), for
every `loss`, β > 0, clip-higher and sequence-level importance ratios; the advantages against
numbers worked out here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grpo_formulas import completion_logps, formula_loss
from megacore.models.grpo import STATS, Clip, group_advantages, token_losses, token_weights

PROMPT, MAXLEN = 3, 6
LENGTHS = [5, 3, 6, 2]  # four completions: two prompts, two each
CASES = {
    "dapo": ("dapo", Clip()),
    "grpo": ("grpo", Clip()),
    "bnpo": ("bnpo", Clip()),
    "dr_grpo": ("dr_grpo", Clip()),
    "beta": ("dapo", Clip(beta=0.04)),
    "clip-higher": ("dapo", Clip(epsilon=0.2, epsilon_high=0.28)),
    "sequence": ("grpo", Clip(sequence_level=True, beta=0.04)),
}


@pytest.fixture(scope="module")
def batch():
    """A tiny Llama, prompts and completions of the lengths above (padded to MAXLEN), the sampling
    policy's and the reference's log-probabilities (the model's own, moved far enough that some
    ratios leave the clip range), and advantages of both signs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg).float()
    n = len(LENGTHS)
    prompt_ids = torch.randint(1, 64, (n, PROMPT))
    completion_ids = torch.randint(1, 64, (n, MAXLEN))
    mask = (torch.arange(MAXLEN)[None] < torch.tensor(LENGTHS)[:, None]).long()
    with torch.no_grad():
        logps = completion_logps(model, prompt_ids, completion_ids)
    old = logps + 0.3 * torch.randn_like(logps)
    ref = logps + 0.5 * torch.randn_like(logps)
    advantages = torch.tensor([0.9, -1.1, 0.4, -0.7])
    return model, prompt_ids, completion_ids, mask, old, ref, advantages


def _ours(logps, old, ref, advantages, mask, loss: str, clip: Clip):
    """`token_losses` over the completion tokens, flat, as a microbatch hands them over."""
    keep = mask.bool()
    lengths = mask.sum(1)
    weights = token_weights(lengths, loss, MAXLEN)
    per = torch.arange(len(LENGTHS))[:, None].expand_as(mask)
    return token_losses(
        logps[keep], old[keep], ref[keep] if clip.beta else None,
        advantages[:, None].expand_as(mask)[keep], weights[:, None].expand_as(mask)[keep].float(),
        per[keep], clip,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_the_formulas(batch, case: str):
    model, prompt_ids, completion_ids, mask, old, ref, advantages = batch
    loss_type, clip = CASES[case]
    results = []
    for fn in (formula_loss, None):
        model.zero_grad()
        logps = completion_logps(model, prompt_ids, completion_ids)
        if fn is None:
            value = _ours(logps, old, ref, advantages, mask, loss_type, clip)[0]
        else:
            value = fn(logps, old, ref, advantages, LENGTHS, loss_type, clip, MAXLEN)
        value.backward()
        results.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)
    assert want.abs() > 1e-3 and any(w.abs().sum() > 0 for w in want_grads)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory, hf_dir: Path, batch):
    """TRL's GRPOTrainer on the same model (its defaults; settings changed per case)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    tok.pad_token = tok.pad_token or tok.eos_token
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False,
                      report_to="none", num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=MAXLEN)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    return GRPOTrainer(model=batch[0], reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=args, train_dataset=data, processing_class=tok)  # fmt: skip


@pytest.mark.slow  # 9 s (TRL's import and trainer); make test checks the formulas above
@pytest.mark.parametrize("case", list(CASES))
def test_trl_computes_the_same_loss_and_metrics(batch, trl_trainer, case: str):
    model, prompt_ids, completion_ids, mask, old, ref, advantages = batch
    loss_type, clip = CASES[case]
    t = trl_trainer
    t.loss_type, t.beta = loss_type, clip.beta
    t.epsilon_low, t.epsilon_high = clip.epsilon, clip.epsilon_high
    t.importance_sampling_level = "sequence" if clip.sequence_level else "token"
    t.current_gradient_accumulation_steps = 1
    t._metrics["train"].clear()
    model.train()
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    with torch.no_grad():
        theirs = t._compute_loss(model, inputs)
        logps = completion_logps(model, prompt_ids, completion_ids)
        ours, stats = _ours(logps, old, ref, advantages, mask, loss_type, clip)
    assert math.isclose(float(ours), float(theirs), rel_tol=1e-5, abs_tol=1e-7), (ours, theirs)
    means = (stats.sums / stats.counts).tolist()
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    got = dict(zip(STATS, means, strict=True))
    for name in (["kl"] if clip.beta else []) + names:
        assert math.isclose(got[name], t._metrics["train"][name][-1], rel_tol=1e-5, abs_tol=1e-7), name
    assert max(got[n] for n in names) > 0  # the case clips something: the comparison is not of zeros


def test_advantages_by_hand():
    """Two groups of three completions, two reward functions (weights 1 and 0.5); None is NaN."""
    nan = float("nan")
    values = torch.tensor([[1.0, 0.0], [0.0, 2.0], [nan, nan], [1.0, nan], [1.0, 0.0], [1.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    adv, rewards, zero = group_advantages(values, weights, 3, "group")
    # Group 1: rewards 1, 1, unscorable -> mean 1, std 0: advantages 0. Group 2: all 1, std 0.
    assert rewards[:2].tolist() == [1.0, 1.0] and math.isnan(rewards[2])
    assert adv.tolist() == [0.0] * 6 and zero.tolist() == [True] * 6
    values = torch.tensor([[0.0], [1.0], [2.0], [4.0], [4.0], [4.0]])
    adv, _, zero = group_advantages(values, torch.ones(1), 3, "group")
    assert torch.allclose(adv[:3], torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + 1e-4))  # std of 0,1,2: 1
    assert adv[3:].tolist() == [0.0] * 3 and zero.tolist() == [False] * 3 + [True] * 3
    adv, _, _ = group_advantages(values, torch.ones(1), 3, "none")
    assert adv.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    adv, _, zero = group_advantages(values, torch.ones(1), 3, "batch")
    std = torch.tensor([0.0, 1, 2, 4, 4, 4]).std()  # the batch's (unbiased), around each group's mean
    assert torch.allclose(adv, torch.tensor([-1.0, 0, 1, 0, 0, 0]) / (std + 1e-4)) and not zero.any()
