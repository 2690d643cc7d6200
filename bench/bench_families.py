"""The families of issues #35 and #52 against transformers' own models: a training step (forward +
backward + fused AdamW) of megacore's Decoder as a small DeepSeek V3, gpt-oss, GLM-4.5 and Qwen 3.5
against transformers' DeepseekV3ForCausalLM, GptOssForCausalLM, Glm4MoeForCausalLM and
Qwen3_5ForCausalLM (same config, weights, batch, dtype, loss and optimizer),
one process, 2 threads, steps interleaved one by one so that load from other processes hits both
alike (benchlib's `paired_rounds`, after a warm-up step of each); tokens/s are each side's fastest
step, ratios the median over rounds of the two sides' times in the same round. transformers as its
users run it: its default attention (SDPA; eager for gpt-oss, whose sinks have no SDPA path there)
and experts implementation.

Full size, DeepSeek V3: hidden 512, 4 layers (the first dense), 8 heads of latent attention (q rank
256, kv rank 128, 64 + 32 rotated dims, v 64), 16 experts of ffn 512 in 4 groups (the best 2
chosen), top-4 and one shared expert. gpt-oss: hidden 512, 4 layers alternating a 128-token sliding
window and full attention, 8 heads of 64 (2 kv heads) with sinks and biases, 16 experts of ffn 512
top-4 with biases and the clamped SwiGLU, YaRN. GLM-4.5: hidden 512, 4 layers (the first dense), 8
heads of 64 (2 kv heads) with q/k/v biases and q/k norms, RoPE over half of each head, 16 experts of
ffn 512 in 4 groups (the best 2 chosen), top-4, one shared expert. Qwen 3.5: hidden 512, 4 layers
(Gated DeltaNet in three: 4 key heads and 8 value heads of 64; gated attention in the fourth: 8
heads of 64, 2 kv heads, a quarter of each head rotated), dense ffn 1536; transformers without
flash-linear-attention runs its own PyTorch delta rule. All: vocab 32000, batch 4 x 512, fp32 and
bf16.
"""

from __future__ import annotations

import os

import torch

from benchlib import THREADS, main, median_ratio, ours_from_hf, step_rounds, train_step
from run import Row


def _deepseek(quick: bool) -> dict:
    if quick:
        sizes = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 2000,
                 "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                 "v_head_dim": 16, "moe_intermediate_size": 64, "intermediate_size": 256}  # fmt: skip
    else:
        sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 32000,
                 "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                 "v_head_dim": 64, "moe_intermediate_size": 512, "intermediate_size": 2048}  # fmt: skip
    return {**sizes, "num_key_value_heads": sizes["num_attention_heads"], "n_routed_experts": 16,
            "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 1024}  # fmt: skip


def _gpt_oss(quick: bool) -> dict:
    if quick:
        sizes = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
                 "vocab_size": 2000, "intermediate_size": 64, "sliding_window": 32}  # fmt: skip
    else:
        sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64,
                 "vocab_size": 32000, "intermediate_size": 512, "sliding_window": 128}  # fmt: skip
    return {**sizes, "num_key_value_heads": 2, "num_local_experts": 16, "num_experts_per_tok": 4,
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
            "layer_types": ["sliding_attention", "full_attention"] * (sizes["num_hidden_layers"] // 2)}  # fmt: skip


def _glm(quick: bool) -> dict:
    if quick:
        sizes = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
                 "vocab_size": 2000, "moe_intermediate_size": 64, "intermediate_size": 256}  # fmt: skip
    else:
        sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64,
                 "vocab_size": 32000, "moe_intermediate_size": 512, "intermediate_size": 2048}  # fmt: skip
    return {**sizes, "num_key_value_heads": 2, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True,
            "use_qk_norm": True, "partial_rotary_factor": 0.5, "max_position_embeddings": 1024}  # fmt: skip


def _qwen35(quick: bool) -> dict:
    if quick:
        sizes = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
                 "vocab_size": 2000, "intermediate_size": 256, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32}  # fmt: skip
    else:
        sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64,
                 "vocab_size": 32000, "intermediate_size": 1536, "linear_num_key_heads": 4,
                 "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64}  # fmt: skip
    return {**sizes, "num_key_value_heads": 2, "max_position_embeddings": 1024}


# name: (transformers' config and model classes, the config's sizes, the note's shape)
FAMILIES = {
    "DeepSeek V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _deepseek,
                    "hidden 512, 4 layers, 16 experts top-4"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", _gpt_oss,
                "hidden 512, 4 layers (sliding 128 / full), 16 experts top-4"),
    "GLM-4.5": ("Glm4MoeConfig", "Glm4MoeForCausalLM", _glm, "hidden 512, 4 layers, 16 experts top-4"),
    "Qwen 3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _qwen35,
                 "hidden 512, 4 layers (3 Gated DeltaNet / 1 gated attention), dense"),
}  # fmt: skip


def _models(family: str, quick: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(ours, transformers' model of `family` with the same weights), and the HF config."""
    import transformers

    config_cls, model_cls, sizes, _ = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**sizes(quick))
    peer = getattr(transformers, model_cls)(hf_config)
    with torch.no_grad():  # routers that route (transformers starts DeepSeek's at zero: every tie)
        for name, p in peer.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 0.02)
    ours = ours_from_hf(peer, hf_config)
    return ours.to(dtype).train(), peer.to(dtype).train(), hf_config


def run(quick: bool) -> list[Row]:
    """Every family of FAMILIES, or those named in BENCH_FAMILIES (comma-separated)."""
    torch.set_num_threads(THREADS)
    batch, seq = (2, 128) if quick else (4, 512)
    rows = []
    chosen = [f for f in os.environ.get("BENCH_FAMILIES", "").split(",") if f] or list(FAMILIES)
    for family, (*_, shape) in ((f, FAMILIES[f]) for f in chosen):
        note = "quick: tiny" if quick else f"{family} shape: {shape}, {batch}x{seq}"
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            ours, peer, hf_config = _models(family, quick, dtype)
            ids = torch.randint(
                0, hf_config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
            )
            steppers = {"ours": train_step(ours, False, ids), "peer": train_step(peer, True, ids)}
            times = step_rounds(steppers, 2 if quick else 7)
            tps = {k: batch * seq / min(v) for k, v in times.items()}
            paired = median_ratio(times["peer"], times["ours"])
            rows.append(
                Row("families", f"train step tokens/s {name} vs transformers' {family}", f"{tps['ours']:.0f}",
                    f"{tps['peer']:.0f}", paired, ">= 1.5x",
                    f"{note}, {THREADS} threads; ratio: median of {len(times['ours'])} paired rounds")
            )  # fmt: skip
            del steppers, ours, peer
    return rows


if __name__ == "__main__":
    main(run)
