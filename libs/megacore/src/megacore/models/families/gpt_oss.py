"""gpt-oss (GptOssForCausalLM, model_type gpt_oss): OpenAI's mixture of experts, as switches of the
one decoder.

Attention: GQA with biases on q, k, v and o (`attention_bias`), a learned sink logit per head in
every softmax (`attention.sinks`, `self_attn.sinks`: `models/sinks.py`), sliding-window layers (128
tokens) alternating with full ones (`layer_types`, even layers sliding by default), YaRN RoPE
(factor 32 over 4096 positions, theta 150000, by default). Experts: a router with a bias, softmax
over its top-k logits (our softmax, top-k and renormalise: the same weights), every expert's
projections with biases, the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

HF layout: Llama's names, `self_attn.sinks`, `mlp.router.{weight,bias}`, and the experts fused and
transposed per layer: `mlp.experts.gate_up_proj` [experts, hidden, 2 x ffn] with gate and up
interleaved on its last dim (gate the even columns), `gate_up_proj_bias` [experts, 2 x ffn],
`down_proj` [experts, ffn, hidden], `down_proj_bias` [experts, hidden]: convert de-interleaves and
transposes them into ours ([experts, out, in]), export puts them back, bit-exact. The published
checkpoints store gate_up_proj and down_proj in MXFP4 (`models/mxfp4.py`: convert dequantizes).
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import gemma3, llama
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap, linear, rename

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURE = "GptOssForCausalLM"
NAME = "gpt-oss"
HF_ATTENTION = "eager"  # transformers' GptOssAttention: eager (or flex), no SDPA path for sinks
SWITCHES = (
    "head_dim", "sliding_window", "layer_types", "attention.bias", "attention.out_bias", "mlp_bias",
    "attention.sinks",
    "activation", "swiglu_alpha", "swiglu_limit", "mlp.type", "mlp.num_experts", "mlp.experts_per_token",
)  # fmt: skip
# transformers' GptOssConfig's RoPE when a config.json gives none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a gpt-oss config.json (defaults as transformers' GptOssConfig)."""
    hf = {"rope_theta": 150000.0, **hf}  # rope_parameters' own theta, where it has one, wins
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf["rope_parameters"] = DEFAULT_ROPE
    c = HFConfig(hf, where)
    if not c.bool("attention_bias", True):
        raise UserError("$.attention_bias: false is not supported (gpt-oss has q/k/v/o biases)", where)
    layers, heads = c.int("num_hidden_layers", 36), c.int("num_attention_heads", 64)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = c.int("sliding_window", 128) if hf.get("sliding_window", 128) is not None else None
    trained = c.int("max_position_embeddings", 131072)
    theta, scaling = c.rope(trained=trained)
    return build_config(
        where,
        family="gpt_oss",
        vocab_size=c.int("vocab_size", 201088),
        hidden_size=c.int("hidden_size", 2880),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=c.int("num_key_value_heads", 8),
        ffn_hidden_size=c.int("intermediate_size", 2880),
        max_seq_len=trained,
        norm={"type": "rmsnorm", "eps": c.float("rms_norm_eps", 1e-5)},
        activation="clamped_swiglu",
        swiglu_alpha=c.float("swiglu_alpha", 1.702),
        swiglu_limit=c.float("swiglu_limit", 7.0),
        head_dim=c.int("head_dim", 64),
        rope={"theta": theta, "scaling": scaling},
        sliding_window=window,
        layer_types=gemma3.layer_types(HFConfig({"layer_types": types}, where), layers),
        attention={"type": "standard", "bias": True, "out_bias": True, "sinks": True},
        mlp_bias=True,
        mlp={
            "type": "moe",
            "num_experts": c.int("num_local_experts", 128),
            "experts_per_token": c.int("num_experts_per_tok", 4),
        },
        tie_embeddings=c.bool("tie_word_embeddings", False),
        bos_id=c.opt_int("bos_token_id"),
        eos_id=c.opt_int("eos_token_id"),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    fixed = config.attention.bias and config.attention.out_bias and config.mlp_bias and config.attention.sinks
    if not fixed or config.activation != "clamped_swiglu" or config.moe is None:
        raise UserError(
            "gpt-oss is a mixture of experts with attention sinks, biases everywhere and the clamped "
            "SwiGLU (attention.sinks, attention.bias, attention.out_bias, mlp_bias, activation clamped_swiglu)",
            "config",
        )
    return llama_style_to_hf(config) | {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        "head_dim": config.head_dim,
        "attention_bias": True,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ["full_attention"] * config.num_layers),
        "num_local_experts": config.moe.num_experts,
        "num_experts_per_tok": config.moe.experts_per_token,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
    }


def _split_gate_up(ts):
    """HF's interleaved, transposed gate_up weight and bias -> our gate and up weights and biases."""
    w, b = ts
    return (
        w[..., ::2].transpose(1, 2).contiguous(),
        w[..., 1::2].transpose(1, 2).contiguous(),
        b[:, ::2].contiguous(),
        b[:, 1::2].contiguous(),
    )


def _fuse_gate_up(ts):
    import torch

    gate, up, gate_bias, up_bias = ts
    weight = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(2)
    return weight, torch.stack([gate_bias, up_bias], dim=-1).flatten(1)


def _transpose(ts):
    return (ts[0].transpose(1, 2).contiguous(),)


def _experts(config: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """A layer's router with its bias and its experts, fused and transposed in HF's layout."""
    maps: list[TensorMap] = []
    linear(maps, f"{hf}.mlp.router", f"{ours}.mlp.router", True)
    e, x = f"{hf}.mlp.experts", f"{ours}.mlp.experts"
    maps.append(
        TensorMap(
            (f"{e}.gate_up_proj", f"{e}.gate_up_proj_bias"),
            (f"{x}.gate_proj.weight", f"{x}.up_proj.weight", f"{x}.gate_proj.bias", f"{x}.up_proj.bias"),
            _split_gate_up,
            _fuse_gate_up,
        )
    )
    maps.append(TensorMap((f"{e}.down_proj",), (f"{x}.down_proj.weight",), _transpose, _transpose))
    maps.append(rename(f"{e}.down_proj_bias", f"{x}.down_proj.bias"))
    return maps


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config, experts=_experts)
