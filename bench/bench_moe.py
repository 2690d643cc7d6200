"""Mixture of experts: a training step (forward + backward + AdamW) of megacore's Decoder as a small
Mixtral against transformers' MixtralForCausalLM (same config, weights, batch, dtype, loss and
optimizer: fused torch AdamW), and against our own dense model of the same active parameters (a
Llama whose MLP is experts_per_token experts wide): what routing and grouping cost.

Both sides compute the language-model loss only (transformers without output_router_logits; ours
with the router loss coefficients at 0), one process, 2 threads, steps interleaved one by one so
that load from other processes hits all alike (benchlib's `paired_rounds`, after a warm-up step of
each: optimizer state, oneDNN's kernel choice); tokens/s are each side's fastest step, ratios the
median over rounds of the two sides' times in the same round. Full size: hidden 512, 4 layers, 8
heads, 4 kv heads, 8 experts of ffn 1024, top-2, vocab 32000, batch 4 x 512, fp32 and bf16.
"""

from __future__ import annotations

import torch

from benchlib import THREADS, main, median_ratio, ours_from_hf, step_rounds, train_step
from run import Row


def _configs(quick: bool) -> tuple[dict, dict]:
    if quick:
        sizes = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 256, "vocab_size": 2000}  # fmt: skip
    else:
        sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "intermediate_size": 1024, "vocab_size": 32000}  # fmt: skip
    moe = {**sizes, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024}
    dense = {**sizes, "intermediate_size": 2 * sizes["intermediate_size"], "max_position_embeddings": 1024}
    return moe, dense


def _models(
    quick: bool, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, object]:
    """(ours Mixtral, transformers' Mixtral with the same weights, ours dense), and the HF config."""
    from transformers import LlamaConfig, MixtralConfig, MixtralForCausalLM

    from megacore.models import Decoder, config_from_hf

    moe, dense = _configs(quick)
    torch.manual_seed(0)
    hf_config = MixtralConfig(**moe, router_aux_loss_coef=0.0)
    peer = MixtralForCausalLM(hf_config)
    ours = ours_from_hf(peer, hf_config)  # the checkpoint names: per-expert w1/w3/w2
    dense_model = Decoder(config_from_hf(LlamaConfig(**dense)))
    dense_model.init_weights()
    return ours.to(dtype).train(), peer.to(dtype).train(), dense_model.to(dtype).train(), hf_config


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(THREADS)
    batch, seq = (2, 128) if quick else (4, 512)
    rows = []
    note = (
        "quick: tiny"
        if quick
        else f"Mixtral 8 experts top-2, hidden 512, 4 layers, {batch}x{seq}, {THREADS} threads"
    )
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours, peer, dense, hf_config = _models(quick, dtype)
        ids = torch.randint(
            0, hf_config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
        )
        steppers = {"ours": train_step(ours, False, ids), "peer": train_step(peer, True, ids),
                    "dense": train_step(dense, False, ids)}  # fmt: skip
        times = step_rounds(steppers, 2 if quick else 7)
        tps = {k: batch * seq / min(v) for k, v in times.items()}
        for other, label, target in (("peer", "vs transformers' Mixtral", ">= 1.5x"),
                                     ("dense", "vs our dense model of the same active parameters", "")):  # fmt: skip
            paired = median_ratio(times[other], times["ours"])
            rows.append(
                Row("moe", f"train step tokens/s {name} {label}", f"{tps['ours']:.0f}", f"{tps[other]:.0f}",
                    paired, target, f"{note}; ratio: median of {len(times['ours'])} paired rounds")
            )  # fmt: skip
        del steppers, ours, peer, dense
    return rows


if __name__ == "__main__":
    main(run)
