"""The sampler (`megacore.models.sampling`, its KV cache `models.kv_cache`) in one process (in a
layout: tests/parallel/test_sampler.py): greedy completions of a batch of prompts of different
lengths (left-padded) equal transformers' `generate` with its own cache and attention mask, token
for token, for every family; the sampling filters equal transformers' logits warpers; draws are the
seed's; the planner's rollout cache is what the cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_cases import build, case_of, load_hf, ours_from_dir
from megacore.models.families import FAMILIES
from megacore.models.kv_cache import KVCache
from megacore.models.sampling import Sampling, filtered_logits, sample

NEW = 12  # past mistral-window's and gpt-oss's windows (8) with the longest prompt


def _prompts(vocab: int, lengths: tuple[int, ...] = (5, 9, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy generate on the prompts left-padded, as its docs batch them."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :], mask[i, longest - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[:, longest:].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_completions_equal_transformers_generate(tmp_path: Path, family: str) -> None:
    torch.manual_seed(0)
    path = build(case_of(family), tmp_path / "hf")
    hf, ours = load_hf(path), ours_from_dir(path)
    prompts = _prompts(hf.config.vocab_size)
    assert sample(ours, prompts, NEW) == _hf_greedy(hf, prompts, NEW)


@pytest.mark.parametrize(
    "setting",
    [Sampling(0.7), Sampling(1.3, top_k=5), Sampling(1.0, top_p=0.6), Sampling(0.8, top_k=20, top_p=0.9)],
    ids=str,
)
def test_the_filters_are_transformers_warpers(setting: Sampling) -> None:
    """Temperature, then top-k, then top-p, as transformers' generate applies its warpers."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 3
    warped = TemperatureLogitsWarper(setting.temperature)(None, logits.clone())
    if setting.top_k is not None:
        warped = TopKLogitsWarper(setting.top_k)(None, warped)
    if setting.top_p is not None:
        warped = TopPLogitsWarper(setting.top_p)(None, warped)
    torch.testing.assert_close(filtered_logits(logits, setting), warped, rtol=0, atol=0)


def test_draws_are_the_seeds_and_stop_ids_end_a_row(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = ours_from_dir(build("llama", tmp_path / "hf"))
    prompts = _prompts(ours.config.vocab_size)
    drawn = sample(ours, prompts, NEW, Sampling(1.0, top_p=0.95, seed=7))
    assert drawn == sample(ours, prompts, NEW, Sampling(1.0, top_p=0.95, seed=7))
    assert drawn != sample(ours, prompts, NEW, Sampling(1.0, top_p=0.95, seed=8))
    # A row draws from its own seed (7 + its index): rows split over two calls, as over two dp
    # ranks, draw what they draw together, and a row's seed alone decides its draws.
    drawn_split = [sample(ours, part, NEW, Sampling(1.0, top_p=0.95), seeds=seeds)
                   for part, seeds in ((prompts[:2], [7, 8]), (prompts[2:], [9]))]  # fmt: skip
    assert drawn_split[0] + drawn_split[1] == drawn
    assert sample(ours, prompts[::-1], NEW, Sampling(1.0, top_p=0.95), seeds=[9, 8, 7]) == drawn[::-1]
    greedy = sample(ours, prompts, NEW)
    assert sample(ours, prompts, NEW, Sampling(1.0, top_k=1, seed=3)) == greedy  # one token left
    stop = greedy[0][3]
    stopped = sample(ours, prompts, NEW, stop_ids={stop})
    for row, full in zip(stopped, greedy, strict=True):  # each row up to its first stop id
        assert row == (full[: full.index(stop) + 1] if stop in full else full)
    # `done` (lm-eval's stop sequences) ends a row where it says: row 1 after 2 ids, the others run on
    assert sample(ours, prompts, NEW, done=lambda row, got: row == 1 and len(got) == 2) == [
        greedy[0], greedy[1][:2], greedy[2],
    ]  # fmt: skip


def test_bad_settings_and_a_full_cache_are_refused() -> None:
    for kwargs, message in [
        ({"temperature": -1.0}, "temperature must be at least 0"),
        ({"top_k": 0}, "top_k must be at least 1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            Sampling(**kwargs)
    cache = KVCache(4)
    cache.update(0, torch.zeros(1, 3, 2))
    cache.advance(3)
    with pytest.raises(ValueError, match="the cache holds 4 positions; 5 asked"):
        cache.update(0, torch.zeros(1, 2, 2))


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gpt_oss", "qwen3_5"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planners_rollout_cache_is_what_the_cache_holds(
    tmp_path: Path, family: str, precision: str
) -> None:
    """The dry run's KV cache of a rollout (`planner.rollout_cache`: grouped kv heads, latent
    attention's latent, linear attention's convolution inputs and fp32 state, a pipeline rank's
    stages' layers) equals the bytes of the buffers the cache holds after the prompts' forward of a
    whole model (fp32, or bf16 weights: bf16 buffers)."""
    from megacore import planner
    from megacore.artifacts.run_spec import ParallelSpec
    from megacore.parallel.layout import Parallelism

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    ours = ours_from_dir(build(case_of(family), tmp_path / "hf")).to(dtype)
    rows, capacity = 3, 20
    cache = KVCache(capacity)
    with torch.no_grad():
        ours(torch.randint(3, 50, (rows, 7)), cache=cache)
    held = sum(t.nbytes for buffers in cache.buffers.values() for t in buffers)
    held += sum(state.nbytes for state in cache.states.values())
    one = Parallelism(ParallelSpec(), precision, 1)
    assert planner.rollout_cache(ours.config, one, 0, rows, capacity) == held > 0
    two = Parallelism(ParallelSpec(pp=2), precision, 2)  # each pipeline rank its stage's layers
    assert sum(planner.rollout_cache(ours.config, two, r, rows, capacity) for r in (0, 1)) == held
