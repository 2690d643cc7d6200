"""Llama 1/2/3/3.1/3.2 and Code Llama: RMSNorm, SwiGLU, GQA, RoPE (theta, linear/dynamic/llama3/yarn
scaling), tied embeddings where the config says so (Llama 3.2 1B/3B).

HF layout (LlamaForCausalLM): model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head. Mistral and Qwen 2/3 use the
same names (`tensor_maps`); Qwen 3 adds self_attn.{q,k}_norm (qk_norm). Mistral and Mixtral also
share its config.json keys but the bias switches (`lineage_fields`, `lineage_to_hf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megacore.config import ModelConfig, sparse_layer
from megacore.errors import UserError
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap, linear, rename, stacked

MODEL_TYPES = ("llama",)
ARCHITECTURE = "LlamaForCausalLM"
NAME = "Llama"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Llama config.json can set to other than
# their defaults (`families.check_expressible` refuses the rest): head_dim and the bias switches.
SWITCHES = ("head_dim", "attention.bias", "attention.out_bias", "mlp_bias")


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a Llama config.json (defaults as transformers' LlamaConfig)."""
    c = HFConfig(hf, where)
    bias = c.bool("attention_bias", False)
    return build_config(
        where,
        family="llama",
        **lineage_fields(c),
        attention={"type": "standard", "bias": bias, "out_bias": bias},
        mlp_bias=c.bool("mlp_bias", False),
    )


def lineage_fields(c: HFConfig) -> dict[str, Any]:
    """The ModelConfig fields Llama, Mistral and Mixtral configs spell alike (defaults as
    transformers' LlamaConfig): everything but the family's own keys (biases, window, experts)."""
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"$.hidden_act: {act!r} is not supported (silu)", c.where)
    heads = c.int("num_attention_heads")
    theta, scaling = c.rope()
    return {
        "vocab_size": c.int("vocab_size"),
        "hidden_size": c.int("hidden_size"),
        "num_layers": c.int("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": c.int("num_key_value_heads", heads),
        "ffn_hidden_size": c.int("intermediate_size"),
        "max_seq_len": c.int("max_position_embeddings", 2048),
        "norm": {"type": "rmsnorm", "eps": c.float("rms_norm_eps", 1e-6)},
        "activation": "swiglu",
        "head_dim": c.int("head_dim") if c.data.get("head_dim") else None,
        "rope": {"theta": theta, "scaling": scaling},
        "tie_embeddings": c.bool("tie_word_embeddings", False),
        "bos_id": c.opt_int("bos_token_id"),
        "eos_id": c.opt_int("eos_token_id"),
    }


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if config.attention.bias != config.attention.out_bias:
        raise UserError(
            "Llama has one attention bias switch; this config's attention.bias and out_bias differ", "config"
        )
    return {
        **lineage_to_hf(config, ARCHITECTURE, "llama"),
        "attention_bias": config.attention.bias,
        "mlp_bias": config.mlp_bias,
    }


def lineage_to_hf(config: ModelConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json keys Llama, Mistral and Mixtral write alike; each family adds its own (Llama
    its bias keys, which Mistral's and Mixtral's configs do not have)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **llama_style_to_hf(config),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
    }


# The checkpoint names of a layer's mixture of experts, by family (what the Hub's checkpoints and
# transformers' save_pretrained write): the module holding `gate` (the router) and `experts.<j>`,
# and each expert's gate, up and down projections.
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3": ("mlp", MLP_NAMES),
    "qwen2": ("mlp", MLP_NAMES),
    "deepseek_v3": ("mlp", MLP_NAMES),
    "glm4_moe": ("mlp", MLP_NAMES),
    "qwen3_5": ("mlp", MLP_NAMES),
    "qwen3_next": ("mlp", MLP_NAMES),
}
# The module of a layer's shared expert(s), by family: Qwen 2 MoE's one (gated), DeepSeek's.
SHARED_EXPERT_NAMES = {
    "qwen2": "shared_expert",
    "deepseek_v3": "shared_experts",
    "glm4_moe": "shared_experts",
    "qwen3_5": "shared_expert",
    "qwen3_next": "shared_expert",
}


def moe_experts(config: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """One layer's router and experts under its family's checkpoint names (`EXPERT_NAMES`), each
    projection stacked over the experts; and a shared expert with its gate (Qwen 2 MoE's names)."""
    module, projections = EXPERT_NAMES[config.family]
    spec = config.moe
    moe, experts = f"{hf}.{module}", range(spec.num_experts)
    maps = (
        [rename(f"{moe}.gate.e_score_correction_bias", f"{ours}.mlp.router_bias")] if spec.router.bias else []
    )
    maps.append(rename(f"{moe}.gate.weight", f"{ours}.mlp.router.weight"))
    for w, p in zip(projections, MLP_NAMES, strict=True):
        names = [f"{moe}.experts.{j}.{w}.weight" for j in experts]
        maps.append(stacked(names, f"{ours}.mlp.experts.{p}.weight"))
    if spec.shared_expert is not None:
        shared = SHARED_EXPERT_NAMES[config.family]
        for p in MLP_NAMES:
            linear(maps, f"{moe}.{shared}.{p}", f"{ours}.mlp.shared_expert.{p}", False)
    if spec.shared_expert is not None and spec.shared_expert.gate:
        maps.append(rename(f"{moe}.shared_expert_gate.weight", f"{ours}.mlp.shared_expert_gate.weight"))
    return maps


def tensor_maps(
    config: ModelConfig, experts: Callable[[ModelConfig, str, str], list[TensorMap]] = moe_experts
) -> list[TensorMap]:
    """Llama's names, the switches' tensors (biases, q/k norms, sinks) where they are on; a sparse
    layer's router and experts from `experts` (gpt-oss stores them otherwise)."""
    maps = [rename("model.embed_tokens.weight", "embed.weight")]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        maps.append(rename(f"{hf}.input_layernorm.weight", f"{ours}.attn_norm.weight"))
        for p in ("q_proj", "k_proj", "v_proj"):
            linear(maps, f"{hf}.self_attn.{p}", f"{ours}.attn.{p}", config.attention.bias)
        linear(maps, f"{hf}.self_attn.o_proj", f"{ours}.attn.o_proj", config.attention.out_bias)
        if config.attention.qk_norm:  # Qwen 3, which keeps Llama's names otherwise
            maps.append(rename(f"{hf}.self_attn.q_norm.weight", f"{ours}.attn.q_norm.weight"))
            maps.append(rename(f"{hf}.self_attn.k_norm.weight", f"{ours}.attn.k_norm.weight"))
        if config.attention.sinks:  # gpt-oss's
            maps.append(rename(f"{hf}.self_attn.sinks", f"{ours}.attn.sinks.weight"))
        maps.append(rename(f"{hf}.post_attention_layernorm.weight", f"{ours}.mlp_norm.weight"))
        if sparse_layer(config, i):
            maps.extend(experts(config, hf, ours))
            continue
        for p in MLP_NAMES:
            linear(maps, f"{hf}.mlp.{p}", f"{ours}.mlp.{p}", config.mlp_bias)
    maps.append(rename("model.norm.weight", "norm.weight"))
    if not config.tie_embeddings:
        maps.append(rename("lm_head.weight", "lm_head.weight"))
    return maps
