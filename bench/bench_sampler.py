"""The sampler (`megacore.models.sampling`, KV cache) against transformers' `generate` with its
own cache: the same random Llama (the CPU benchmarks' 125M shape; `--quick`: a tiny one) in
transformers and converted to ours (`hf_state_dict_to_ours`), the same 8 prompts of 24 to 64 tokens
(left-padded, transformers given their attention mask), 64 new tokens each, greedy, fp32, one
process with 2 threads. Each round times one batch on each side (benchlib's `paired_rounds`, after
a warm-up batch); the ratio is the median of the rounds' tokens/s ratios (> 1: ours faster; goal
1.5x, #51). Checked: the two sides' completions are the same ids."""

from __future__ import annotations

import time

import torch

from benchlib import (
    LLAMA_125M,
    LLAMA_TINY,
    THREADS,
    Setup,
    hf_llama,
    main,
    median_ratio,
    paired_rounds,
    rounds_note,
)
from run import Row

BATCH, NEW, VOCAB = 8, 64, 32000


def _models(setup: Setup):
    from megacore.models import Decoder, config_from_hf, hf_state_dict_to_ours

    hf = hf_llama(setup).eval()
    ours = Decoder(config_from_hf(hf.config), attention="sdpa").eval()
    ours.load_state_dict(hf_state_dict_to_ours(ours.config, hf.state_dict()))
    return hf, ours


def _prompts(setup: Setup) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(setup.seq // 8, setup.seq // 4, BATCH).long().tolist()
    return [torch.randint(3, setup.vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_generate(hf, prompts: list[list[int]], new: int) -> list[list[int]]:
    longest = max(map(len, prompts))
    ids, mask = (
        torch.zeros(len(prompts), longest, dtype=torch.long),
        torch.zeros(len(prompts), longest, dtype=torch.long),
    )
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :], mask[i, longest - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[:, longest:].tolist()


def run(quick: bool) -> list[Row]:
    from megacore.models.sampling import sample

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    setup = Setup(**{**vars(LLAMA_TINY if quick else LLAMA_125M), "vocab": 256 if quick else VOCAB})
    new = 8 if quick else NEW
    hf, ours = _models(setup)
    prompts = _prompts(setup)
    sides = {"ours": lambda: sample(ours, prompts, new), "hf": lambda: _hf_generate(hf, prompts, new)}
    outputs: dict[str, list] = {}

    def measure(side: str, r: int) -> float:
        t = time.perf_counter()
        outputs[side] = sides[side]()
        return len(prompts) * new / (time.perf_counter() - t)

    rates = paired_rounds(sides, 1 if quick else setup.rounds, measure, warmup=True)
    same = outputs["ours"] == outputs["hf"]
    note = (
        f"Llama {setup.hidden}x{setup.layers}, batch {BATCH} prompts of {len(prompts[0])}-{len(prompts[-1])} "
        f"tokens, {new} new, greedy, fp32, {THREADS} threads; {rounds_note(rates['ours'], rates['hf'])}"
        + ("" if same else "; the completions differ")
    )
    ours_best, hf_best = f"{max(rates['ours']):.0f} tok/s", f"{max(rates['hf']):.0f} tok/s"
    ratio = median_ratio(rates["ours"], rates["hf"])
    metric = "tokens/s, greedy with a KV cache, vs transformers generate"
    return [Row("sampler", metric, ours_best, hf_best, ratio, ">= 1.5x (#51)", note, passed=same)]


if __name__ == "__main__":
    main(run)
