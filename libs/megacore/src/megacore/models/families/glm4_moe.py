"""GLM-4.5, 4.6 and 4.7 (Glm4MoeForCausalLM, model_type glm4_moe) as parts of the one decoder:
DeepSeek V3's mixture (`deepseek_v3.moe_from_hf`: sigmoid scores with the correction bias
`e_score_correction_bias`, `n_group` groups of which the best `topk_group`, renormalised top-k times
`routed_scaling_factor`, `n_shared_experts` ungated shared experts, the first `first_k_dense_replace`
layers dense) under standard grouped-query attention: biases on q, k and v (`attention_bias`; none on
o), per-head q/k RMSNorms before RoPE when `use_qk_norm`, and a partial rotary embedding, the first
half of each head's dims by default (`partial_rotary_factor`: `rope.partial_rotary_factor`).

HF layout: Llama's names, `self_attn.{q,k}_norm`, and DeepSeek V3's mixture names
(`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.<j>.{gate,up,down}_proj`,
`mlp.shared_experts.*`). The published checkpoints' multi-token-prediction layers
(`num_nextn_predict_layers`) are left out on convert with one line, as DeepSeek V3's.
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import deepseek_v3, llama
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap

MODEL_TYPES = ("glm4_moe",)
ARCHITECTURE = "Glm4MoeForCausalLM"
NAME = "GLM-4.5"
# The ModelConfig fields besides `families.SHARED_FIELDS` a GLM-4.5 config.json can set to other
# than their defaults (`families.check_expressible` refuses the rest).
SWITCHES = (
    "head_dim", "attention.bias", "attention.qk_norm", "rope.partial_rotary_factor", "mlp.type",
    "mlp.num_experts", "mlp.experts_per_token", "mlp.router.renormalize_top_k", "mlp.dense_layers",
    "mlp.dense_ffn_hidden_size", "mlp.shared_expert.size", "mlp.router.scoring", "mlp.router.bias",
    "mlp.router.groups", "mlp.router.groups_chosen", "mlp.router.scaling",
)  # fmt: skip
# Glm4MoeConfig's defaults of the mixture's keys.
MOE_DEFAULTS = {
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "n_routed_experts": 128,
    "num_experts_per_tok": 8, "intermediate_size": 10944,
}  # fmt: skip
extra_tensors = deepseek_v3.extra_tensors  # the multi-token-prediction layers


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a GLM-4.5 config.json (defaults as transformers' Glm4MoeConfig)."""
    c = HFConfig(hf, where)
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"$.hidden_act: {act!r} is not supported (silu)", where)
    heads, layers = c.int("num_attention_heads", 96), c.int("num_hidden_layers", 46)
    trained = c.int("max_position_embeddings", 131072)
    theta, scaling = c.rope(trained=trained, partial=True)
    width = c.int("moe_intermediate_size", 1408)
    dense = list(range(min(c.int("first_k_dense_replace", 1, minimum=0), layers)))
    hidden = c.int("hidden_size", 4096)
    return build_config(
        where,
        family="glm4_moe",
        vocab_size=c.int("vocab_size", 151552),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=c.int("num_key_value_heads", 8),
        ffn_hidden_size=width,
        max_seq_len=trained,
        norm={"type": "rmsnorm", "eps": c.float("rms_norm_eps", 1e-5)},
        activation="swiglu",
        head_dim=c.int("head_dim", hidden // heads),
        rope={"theta": theta, "scaling": scaling, "partial_rotary_factor": c.partial_rotary(default=0.5)},
        attention={
            "type": "standard",
            "bias": c.bool("attention_bias", False),
            "qk_norm": c.bool("use_qk_norm", False),
        },
        mlp=deepseek_v3.moe_from_hf(c, width, dense, MOE_DEFAULTS),
        tie_embeddings=c.bool("tie_word_embeddings", False),
        bos_id=c.opt_int("bos_token_id"),
        eos_id=c.opt_int("eos_token_id"),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if config.attention.out_bias:  # (latent attention: check_expressible refused it first)
        raise UserError("GLM-4.5 has no bias on the attention's output projection", "config")
    return (
        llama_style_to_hf(config)
        | deepseek_v3.moe_to_hf(config, NAME)
        | {
            "architectures": [ARCHITECTURE],
            "model_type": "glm4_moe",
            "head_dim": config.head_dim,
            "attention_bias": config.attention.bias,
            "use_qk_norm": config.attention.qk_norm,
            "partial_rotary_factor": config.rope.partial_rotary_factor,
        }
    )


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
