"""Tiny random Hugging Face models for every family/variant, built from transformers' real config
classes and saved with save_pretrained (shared by the models and convert tests)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    FalconConfig,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import Qwen3NextConfig

from megacore.models import Decoder, check_maps, config_from_hf, hf_state_dict_to_ours
from megacore.models.families import FAMILIES, family_for_model_type, hf_attention

_SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
_LLAMA = {**_SMALL, "intermediate_size": 96, "vocab_size": 101, "max_position_embeddings": 64}
# The Qwen 3.5 and Qwen3-Next cases' layers (below) and their experts.
_HYBRID = {**_LLAMA, "num_hidden_layers": 3, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 16,
           "max_position_embeddings": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 16, "linear_value_head_dim": 8,
           "layer_types": ["linear_attention", "full_attention", "linear_attention"]}  # fmt: skip
_HYBRID_EXPERTS = {"moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "num_experts": 8,
                   "num_experts_per_tok": 2}  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (config class, kwargs, sequence length used for the comparison)
CASES: dict[str, tuple[type, dict, int]] = {
    "llama": (LlamaConfig, {**_LLAMA, "num_key_value_heads": 4}, 24),
    "llama2-70b-gqa": (LlamaConfig, {**_LLAMA, "num_key_value_heads": 2}, 24),
    "llama-bias-tied": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        24,
    ),
    "codellama": (LlamaConfig, {**_LLAMA, "num_key_value_heads": 4, "vocab_size": 32016, "rope_theta": 1e6}, 24),
    "llama-linear-rope": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        24,
    ),
    # max_position_embeddings 16 < 40 tokens: the dynamic NTK base is actually stretched.
    "llama-dynamic-rope": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 2, "max_position_embeddings": 16,
         "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        40,
    ),
    "llama3.1": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 128256, "rope_theta": 500000.0,
         "rope_scaling": LLAMA3_ROPE, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
        24,
    ),
    "mistral-window": (
        MistralConfig,
        {**_LLAMA, "num_key_value_heads": 2, "sliding_window": 8, "vocab_size": 128},
        24,
    ),
    "falcon-7b": (
        FalconConfig,
        {**_SMALL, "vocab_size": 90, "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False},
        24,
    ),
    "falcon-40b": (
        FalconConfig,
        {**_SMALL, "vocab_size": 90, "new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True},
        24,
    ),
    "falcon-sequential-bias": (
        FalconConfig,
        {**_SMALL, "vocab_size": 90, "multi_query": False, "parallel_attn": False, "bias": True,
         "tie_word_embeddings": False},
        24,
    ),
    # Qwen 2 / 2.5: biases on q, k, v only (Qwen2Config has no switch for them), GQA, untied.
    "qwen2": (
        Qwen2Config,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "rope_theta": 1e6, "tie_word_embeddings": False},
        24,
    ),
    # Qwen 2.5 0.5B style: tied embeddings, few kv heads (here one).
    "qwen2.5-tied": (
        Qwen2Config,
        {**_LLAMA, "num_key_value_heads": 1, "vocab_size": 120, "rope_theta": 1e6, "tie_word_embeddings": True,
         "bos_token_id": 118, "eos_token_id": 119},
        24,
    ),
    # The sliding-window switches set for every layer (max_window_layers 0), a window shorter than
    # the sequence.
    "qwen2-window": (
        Qwen2Config,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "use_sliding_window": True, "sliding_window": 8,
         "max_window_layers": 0},
        24,
    ),
    # Qwen 3: RMSNorm on each q and k head before RoPE, no biases, head_dim 32 (not 64 / 4 heads).
    "qwen3": (
        Qwen3Config,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32, "rope_theta": 1e6},
        24,
    ),
    # Llama 3.2 1B/3B style: tied embeddings and llama3 RoPE scaling.
    "llama3.2": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": True,
         "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}},
        24,
    ),
    # YaRN, beyond the original context of 16 (40 tokens). Llama in transformers 5's rope_parameters
    # form with transformers' defaults (beta_fast 32, beta_slow 1, truncate, attention factor from
    # the factor); Qwen 2.5's published form (classic rope_scaling, "type"); Mistral with every
    # optional field (betas, the mscale pair, no truncation); Qwen 3 with its own attention factor.
    "llama-yarn": (
        LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 2,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16}},
        40,
    ),
    "qwen2.5-yarn": (
        Qwen2Config,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "rope_theta": 1e6,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        40,
    ),
    "mistral-yarn": (
        MistralConfig,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 128, "sliding_window": None,
         "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                          "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                          "truncate": False}},
        40,
    ),
    "qwen3-yarn": (
        Qwen3Config,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32, "rope_theta": 1e6,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "attention_factor": 1.25}},
        40,
    ),
    # Falcon and Gemma 3 carry YaRN too (transformers' rotary embeddings take any rope type; Gemma 3's
    # on its global layers only).
    "falcon-yarn": (
        FalconConfig,
        {**_SMALL, "vocab_size": 90, "new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True,
         "max_position_embeddings": 64,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "beta_fast": 16.0}},
        40,
    ),
    # Gemma 3 (Gemma3ForCausalLM): (1 + w) RMSNorms, four per block and on q/k heads, embeddings
    # scaled by sqrt(hidden), tanh GeGLU, head_dim 32 (not 64 / 4 heads), scores scaled by
    # query_pre_attn_scalar ** -0.5 (24, not head_dim), tied; local layers (every 3rd is global:
    # sliding, sliding, full, sliding) with a window of 8 over 24 tokens and their own RoPE base,
    # global ones with another base and Gemma 3 4B's linear scaling (bases not transformers'
    # defaults, so that one lost on the way shows). pad_token_id 0 (Gemma's):
    # transformers' embedding leaves that row no gradient from the input side (padding_idx), which
    # ours does not model; the test tokens never include id 0.
    "gemma3": (
        Gemma3TextConfig,
        {**_LLAMA, "num_hidden_layers": 4, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32,
         "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 3,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5}}},
        24,
    ),
    "gemma3-yarn": (
        Gemma3TextConfig,
        {**_LLAMA, "num_hidden_layers": 4, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32,
         "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 3,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                             "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                "original_max_position_embeddings": 16}}},
        40,
    ),
    # Mixtral (MixtralForCausalLM): every MLP 4 or 8 SwiGLU experts, top-2, GQA; the 8-expert one
    # with a sliding window shorter than its test sequence.
    "mixtral": (
        MixtralConfig,
        {**_LLAMA, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        24,
    ),
    "mixtral-8x-window": (
        MixtralConfig,
        {**_LLAMA, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
         "sliding_window": 8},
        24,
    ),
    # Qwen 3 MoE (Qwen3MoeForCausalLM): Qwen 3's q/k norms and explicit head_dim, every MLP experts
    # of moe_intermediate_size (not intermediate_size, which only dense layers would use), top-2 of
    # 4 renormalised (Qwen3-30B-A3B's norm_topk_prob), or top-3 of 8 not (transformers' default).
    "qwen3-moe": (
        Qwen3MoeConfig,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32, "rope_theta": 1e6,
         "moe_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
        24,
    ),
    "qwen3-moe-unnormed": (
        Qwen3MoeConfig,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32, "rope_theta": 1e6,
         "moe_intermediate_size": 40, "num_experts": 8, "num_experts_per_tok": 3},
        24,
    ),
    # Dense layers among the sparse ones: decoder_sparse_step 2 makes layer 0 dense, mlp_only_layers
    # layer 3; the dense MLPs intermediate_size wide, the experts moe_intermediate_size.
    "qwen3-moe-dense-layers": (
        Qwen3MoeConfig,
        {**_LLAMA, "num_hidden_layers": 4, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 32,
         "moe_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "decoder_sparse_step": 2, "mlp_only_layers": [3]},
        24,
    ),
    # Qwen 2 MoE (Qwen2MoeForCausalLM): q/k/v biases, experts top-2 of 4 (not renormalised, its
    # default) beside a shared expert with its sigmoid gate; layer 0 dense (mlp_only_layers).
    "qwen2-moe": (
        Qwen2MoeConfig,
        {**_LLAMA, "num_hidden_layers": 3, "num_key_value_heads": 2, "vocab_size": 120, "rope_theta": 1e6,
         "moe_intermediate_size": 40, "shared_expert_intermediate_size": 56, "num_experts": 4,
         "num_experts_per_tok": 2, "mlp_only_layers": [0]},
        24,
    ),
    # DeepSeek V3 (DeepseekV3ForCausalLM): latent attention with q's low-rank pair (or one q_proj),
    # interleaved RoPE on its 8 rope dims; the first 2 layers dense, then 8 routed experts in 2
    # groups (the best 1 chosen) beside a shared one, sigmoid routing with the balancing bias,
    # top-2 renormalised and scaled by 2.5; the other with YaRN (mscale_all_dim: the score scale).
    "deepseek-v3": (
        DeepseekV3Config,
        {**_LLAMA, "num_hidden_layers": 4, "num_key_value_heads": 4, "vocab_size": 120,
         "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
         "n_group": 2, "topk_group": 1, "first_k_dense_replace": 2, "q_lora_rank": 32, "kv_lora_rank": 24,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "routed_scaling_factor": 2.5},
        24,
    ),
    "deepseek-v3-yarn": (
        DeepseekV3Config,
        {**_LLAMA, "num_hidden_layers": 3, "num_key_value_heads": 4, "vocab_size": 120,
         "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 3,
         "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 24,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "norm_topk_prob": False,
         "max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32.0, "beta_slow": 1.0}},
        40,
    ),
    # gpt-oss (GptOssForCausalLM): a sliding layer (window 8 over 24 tokens) then a full one, biases
    # on q/k/v/o, a sink per head, experts top-2 of 4 with biases and the clamped SwiGLU (its limit
    # 0.3, not 7, so that the clamps bind on these weights), the router's bias, YaRN.
    "gpt-oss": (
        GptOssConfig,
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 16, "intermediate_size": 32,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "swiglu_limit": 0.3,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
        24,
    ),
    # GLM-4.5 (Glm4MoeForCausalLM): GQA with q/k/v biases, q/k norms and RoPE over the first half
    # of each head (partial_rotary_factor 0.5); the first layer dense, then 8 routed experts in 2
    # groups (the best 1 chosen) beside a shared one, sigmoid routing with the balancing bias, top-2
    # renormalised and scaled by 2.5.
    "glm4-moe": (
        Glm4MoeConfig,
        {**_LLAMA, "num_hidden_layers": 3, "num_key_value_heads": 2, "vocab_size": 120, "head_dim": 16,
         "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
         "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
         "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5},
        24,
    ),
    # Qwen 3.5 (Qwen3_5ForCausalLM): Gated DeltaNet linear attention in layers 0 and 2 (2 key heads
    # 16 wide, 4 value heads 8 wide: v heads narrower than k's), full attention with an output gate,
    # q/k norms and RoPE over a quarter of each head in layer 1; 80 tokens: past the delta rule's
    # chunk of 64, which it pads.
    "qwen3.5": (Qwen3_5TextConfig, _HYBRID, 80),
    # Qwen 3.5 MoE: the same layers (two), each MLP 8 experts (top 2, renormalised) and a gated
    # shared one.
    "qwen3.5-moe": (
        Qwen3_5MoeTextConfig,
        {**_HYBRID, **_HYBRID_EXPERTS, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
        80,
    ),
    # Qwen3-Next: Qwen 3.5 MoE's layers with q/k/v/z and b/a interleaved by key head in the linear
    # layers' inputs (2 key heads, each serving 2 value heads), the last layer's MLP dense
    # (mlp_only_layers) among mixtures of 8 experts (top 2, renormalised) with a gated shared one.
    "qwen3-next": (Qwen3NextConfig, {**_HYBRID, **_HYBRID_EXPERTS, "mlp_only_layers": [2]}, 80),
}  # fmt: skip


def attention_impl(config: object) -> str:
    """transformers' attn_implementation for a config (a PretrainedConfig or a config.json dict):
    SDPA, but eager where a family has no SDPA path (gpt-oss's sinks)."""
    return hf_attention(config.get("model_type") if isinstance(config, dict) else config.model_type)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights big enough that a wrong mapping or a small numerical slip shows in the logits
    (the default init, std 0.02, makes every logit nearly zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("sinks"):  # logits comparable with the scores', so that they matter
                p.copy_(noise)
            elif "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.08 * noise)
        for name, b in model.named_buffers():  # DeepSeek's balancing bias: a buffer, not a parameter
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build(case: str, out: Path, dtype: torch.dtype = torch.float32, **overrides: object) -> Path:
    """Save a tiny random model of `case` to `out` and return `out`."""
    cls, kwargs, _ = CASES[case]
    config = cls(**{**kwargs, **overrides})
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attention_impl(config)
    )
    randomize(model)
    model.to(dtype).save_pretrained(out)
    return out


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    impl = attention_impl(json.loads((Path(path) / "config.json").read_text()))
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=dtype).eval()


def tokens(vocab: int, seq: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def peft_chain(root: Path, hf: Path, rank: int, alpha: int, targets: list[str], seed: int) -> dict[str, Path]:
    """`hf` converted to root/base; a PEFT LoRA adapter on it with B drawn (PEFT's zero B would give A
    no gradient), saved by PEFT in root/peft and imported with `mega-convert peft` as root/adapter."""
    from peft import LoraConfig, get_peft_model

    from helpers import run_in_process

    assert run_in_process("mega-convert", "hf", hf, root / "base").returncode == 0
    model = get_peft_model(load_hf(hf), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "peft")
    proc = run_in_process("mega-convert", "peft", root / "peft", root / "adapter", "--base", root / "base")
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "hf": hf, "base": root / "base", "peft": root / "peft", "adapter": root / "adapter"}


def case_of(family: str) -> str:
    """The first case in CASES whose transformers config is this family's model type."""
    for name, (config_class, _, _) in CASES.items():
        if family_for_model_type(config_class.model_type, name) is FAMILIES[family]:
            return name
    raise AssertionError(f"family {family}: no case of its model types in tests/hf_cases.py CASES; add one")


def ours_from_dir(path: Path, pad_multiple: int | None = None) -> Decoder:
    """Our Decoder of a Hugging Face model directory (its config.json and model.safetensors), in eval mode."""
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), pad_multiple=pad_multiple)
    check_maps(cfg)
    model = Decoder(cfg)
    model.load_state_dict(hf_state_dict_to_ours(cfg, load_file(path / "model.safetensors")))
    return model.eval()
