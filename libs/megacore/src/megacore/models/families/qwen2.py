"""Qwen 2 / 2.5: the Llama layout (RMSNorm, SwiGLU, GQA, RoPE) with biases on q, k and v only,
tied embeddings in the small sizes, and a sliding window as the config's switches set it.

Qwen 2 MoE (Qwen2MoeForCausalLM, model_type qwen2_moe; Qwen1.5-MoE, Qwen2-57B-A14B): the same
decoder whose MLPs are mixtures of experts (`models/moe.py`) as Qwen 3 MoE's (`moe_fields`: softmax
routing, top `num_experts_per_tok`, renormalised when `norm_topk_prob`; dense layers where
`mlp_only_layers` or `decoder_sparse_step` say), each with a shared expert every token goes through
(`mlp.shared_expert.{gate,up,down}_proj`, `shared_expert_intermediate_size` wide) scaled by
sigmoid(`mlp.shared_expert_gate`); q/k/v biases as `qkv_bias` says.

HF layout (Qwen2ForCausalLM): Llama's tensor names (`llama.tensor_maps`). Qwen2Config has no bias
switch: q/k/v always have one, o_proj and the MLP never; its `head_dim`, when a config.json carries
one, is what the attention uses (else hidden_size / heads).

The sliding window, as transformers' Qwen2Config and Qwen3Config read it: a layer attends through
the `sliding_window` most recent tokens when `use_sliding_window` is true and its `layer_types`
entry is "sliding_attention"; without `layer_types`, the layers from `max_window_layers` on are the
sliding ones. The decoder has one window for every layer, so a window on some layers only is
refused; published Qwen 2 / 2.5 / 3 configs set use_sliding_window false (no window).
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap

MODEL_TYPES = ("qwen2", "qwen2_moe")
ARCHITECTURE = "Qwen2ForCausalLM"
MOE_ARCHITECTURE = "Qwen2MoeForCausalLM"
NAME = "Qwen 2"
# The experts' switches Qwen 2 MoE and Qwen 3 MoE configs share (`moe_fields`).
MOE_SWITCHES = (
    "mlp.type", "mlp.num_experts", "mlp.experts_per_token", "mlp.router.renormalize_top_k",
    "mlp.dense_layers", "mlp.dense_ffn_hidden_size",
)  # fmt: skip
# The ModelConfig fields besides `families.SHARED_FIELDS` a Qwen 2 (or Qwen 2 MoE) config.json can
# set to other than their defaults (`families.check_expressible` refuses the rest); attention.bias is
# always set, but for a Qwen 2 MoE without qkv_bias.
SWITCHES = (
    "head_dim",
    "sliding_window",
    "attention.bias",
    *MOE_SWITCHES,
    "mlp.shared_expert.size",
    "mlp.shared_expert.gate",
)
_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window(c: HFConfig, num_layers: int) -> int | None:
    """The window every layer attends through, None for full attention; UserError where the
    config's layers disagree (transformers' defaults: use_sliding_window false, max_window_layers 28)."""
    window = c.data.get("sliding_window") if c.bool("use_sliding_window", False) else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UserError(f"$.sliding_window: expected a positive integer or null, got {window!r}", c.where)
    types = c.data.get("layer_types")
    if types is None:
        first = c.int("max_window_layers", 28, minimum=0)
        types = [_LAYER_TYPES[window is not None and i >= first] for i in range(num_layers)]
    elif not (isinstance(types, list) and len(types) == num_layers and set(types) <= set(_LAYER_TYPES)):
        raise UserError(
            f"$.layer_types: expected {num_layers} entries, each one of {list(_LAYER_TYPES)}", c.where
        )
    sliding = types.count("sliding_attention")
    if sliding and window is None:  # transformers fails on this one too (no window to build a mask)
        raise UserError(
            "$.layer_types: sliding layers but no window (use_sliding_window false or sliding_window null)",
            c.where,
        )
    if 0 < sliding < num_layers:
        raise UserError(
            f"$.layer_types: a sliding window on {sliding} of {num_layers} layers cannot be expressed "
            "(one window for all layers or none)",
            c.where,
        )
    return window if sliding else None


def common_fields(c: HFConfig) -> dict[str, Any]:
    """The ModelConfig fields Qwen 2 and Qwen 3 configs share (defaults as transformers' classes)."""
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"$.hidden_act: {act!r} is not supported (silu)", c.where)
    heads, layers = c.int("num_attention_heads"), c.int("num_hidden_layers")
    # Qwen2Config's own default when the key is absent is 32 kv heads; null means one per head.
    kv = c.data.get("num_key_value_heads", 32)
    trained = c.int("max_position_embeddings", 32768)
    theta, scaling = c.rope(trained=trained)
    return {
        "vocab_size": c.int("vocab_size"),
        "hidden_size": c.int("hidden_size"),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": heads if kv is None else c.int("num_key_value_heads", 32),
        "ffn_hidden_size": c.int("intermediate_size"),
        "max_seq_len": trained,
        "norm": {"type": "rmsnorm", "eps": c.float("rms_norm_eps", 1e-6)},
        "activation": "swiglu",
        "rope": {"theta": theta, "scaling": scaling},
        "sliding_window": sliding_window(c, layers),
        "tie_embeddings": c.bool("tie_word_embeddings", False),
        "bos_id": c.opt_int("bos_token_id"),
        "eos_id": c.opt_int("eos_token_id"),
    }


def moe_fields(
    c: HFConfig,
    width: int,
    experts: int,
    per_token: int,
    layers: int | None = None,
    renormalize: bool = False,
) -> dict[str, Any]:
    """A Qwen 2 MoE, Qwen 3 MoE or Qwen3-Next config's experts (the defaults, which differ, given;
    `layers` None: num_hidden_layers required): routed experts `moe_intermediate_size` wide, and
    dense layers (`mlp_only_layers`, and those a `decoder_sparse_step` skips) `intermediate_size`
    wide."""
    layers = c.int("num_hidden_layers") if layers is None else c.int("num_hidden_layers", layers)
    step = c.int("decoder_sparse_step", 1)
    only = c.data.get("mlp_only_layers") or []
    if not (isinstance(only, list) and all(type(i) is int and i >= 0 for i in only)):
        raise UserError(f"$.mlp_only_layers: expected a list of layer indices, got {only!r}", c.where)
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    moe = {
        "type": "moe",
        # config.json says num_experts; transformers 5's to_dict, num_local_experts
        "num_experts": c.int("num_experts" if "num_experts" in c.data else "num_local_experts", experts),
        "experts_per_token": c.int("num_experts_per_tok", per_token),
        "router": {"renormalize_top_k": c.bool("norm_topk_prob", renormalize)},
        "dense_layers": dense,
        "dense_ffn_hidden_size": c.int("intermediate_size") if dense else None,
    }
    return {"ffn_hidden_size": c.int("moe_intermediate_size", width), "mlp": moe}


def moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The experts' config.json keys of Qwen 2 MoE and Qwen 3 MoE."""
    moe = config.moe
    return {
        "moe_intermediate_size": config.ffn_hidden_size,
        "intermediate_size": moe.dense_ffn_hidden_size or config.ffn_hidden_size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "norm_topk_prob": moe.router.renormalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
    }


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    fields = common_fields(c)
    bias = True
    if hf.get("model_type") == "qwen2_moe":  # defaults as Qwen2MoeConfig's
        fields |= moe_fields(c, 1408, 60, 4)
        fields["mlp"]["shared_expert"] = {
            "size": c.int("shared_expert_intermediate_size", 5632),
            "gate": True,
        }
        bias = c.bool("qkv_bias", True)
    return build_config(
        where,
        family="qwen2",
        **fields,
        head_dim=c.int("head_dim") if c.data.get("head_dim") else None,
        attention={"type": "standard", "bias": bias},
        mlp_bias=False,
    )


def common_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys Qwen 2 and Qwen 3 share."""
    window = config.sliding_window
    return {
        **llama_style_to_hf(config),
        "hidden_act": "silu",
        # One window for all layers: every layer from layer 0 on slides.
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else config.num_layers,
    }


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe is not None
    if not (config.attention.bias or moe):
        raise UserError(
            "Qwen 2 always has biases on q, k and v; this config has none (attention.bias)", "config"
        )
    shared = moe and config.moe.shared_expert
    if moe and not (shared and shared.gate):
        raise UserError(
            "Qwen 2 MoE has a gated shared expert in every sparse layer; this config has none", "config"
        )
    out = {
        "architectures": [MOE_ARCHITECTURE if moe else ARCHITECTURE],
        "model_type": "qwen2_moe" if moe else "qwen2",
        **common_hf(config),
    }
    if config.head_dim * config.num_heads != config.hidden_size:  # published configs carry none
        out["head_dim"] = config.head_dim
    if not moe:
        return out
    # Qwen2MoeConfig's default layer types slide on every other layer: say what every layer does.
    kind = "sliding_attention" if config.sliding_window is not None else "full_attention"
    return (
        out
        | moe_to_hf(config)
        | {
            "shared_expert_intermediate_size": shared.size,
            "qkv_bias": config.attention.bias,
            "layer_types": [kind] * config.num_layers,
        }
    )


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
