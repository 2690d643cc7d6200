"""Qwen 3.5's language model (Qwen3_5ForCausalLM, model_type qwen3_5_text) as parts of the one
decoder: three of every four layers are Gated DeltaNet linear attention (`layer_types`
"linear_attention", `linear_attention`: `models.linear_attention`), the others standard attention
with q/k norms, an output gate (`attention.output_gate`) and RoPE over the first quarter of each
head (`rope.partial_rotary_factor`, 0.25 by default); every norm is zero-centred, x / rms(x) ·
(1 + w) in fp32 (`norm` rmsnorm_plus1, Gemma's), but linear attention's per-head output norm,
a plain scale; dense SwiGLU MLPs. Its RoPE is multimodal (mrope_section), which for text, every
position the same in its three sections, is the plain one. Qwen 3.5 MoE (Qwen3_5MoeForCausalLM,
model_type qwen3_5_moe_text) is the same decoder whose every MLP is a mixture: `num_experts`
SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` chosen by a softmax router and
renormalised, beside a shared expert gated by sigmoid of a linear of the input (Qwen 2 MoE's).

HF layout: Llama's names for the embedding, the norms and the MLPs; a full-attention layer's
`self_attn.{q,k,v,o}_proj` and `self_attn.{q,k}_norm`, its q_proj holding each head's q rows and
then its gate's (split into ours, `attn.q_proj` and `attn.gate_proj`); a linear layer's
`linear_attn.in_proj_qkv` (q, k and v rows one after the other, split into ours),
`linear_attn.in_proj_{z,b,a}`, `linear_attn.conv1d.weight` (the filters of q's, k's and v's
channels, split likewise), `linear_attn.{dt_bias,A_log}`, `linear_attn.norm.weight` and
`linear_attn.out_proj`; a mixture's `mlp.gate`, `mlp.experts.<j>.{gate,up,down}_proj`,
`mlp.shared_expert.*` and `mlp.shared_expert_gate` (as transformers saves them). Published
checkpoints' multi-token-prediction module (`mtp.*`) is left out on convert with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megacore.config import ModelConfig, linear_layer
from megacore.config_parts import PlusOneRMSNormSpec
from megacore.errors import UserError
from megacore.models.families import llama
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap, concatenated, per_head, rename
from megacore.parts import linear

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
# The multimodal checkpoints (Qwen3_5ForConditionalGeneration, the published ones) whose language
# model is read (`families.language_prefix`): its config.json's text_config, its tensors under
# this prefix; the vision encoder is left out with one line (`extra_tensors`).
MULTIMODAL = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model."}
ARCHITECTURE = "Qwen3_5ForCausalLM"
MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
NAME = "Qwen 3.5"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Qwen 3.5 config.json can set to other
# than their defaults (`families.check_expressible` refuses the rest).
SWITCHES = (
    "head_dim", "layer_types", "norm.type", "rope.partial_rotary_factor", "attention.bias",
    "attention.qk_norm", "attention.output_gate", "linear_attention.type", "linear_attention.key_heads",
    "linear_attention.value_heads", "linear_attention.key_head_dim", "linear_attention.value_head_dim",
    "linear_attention.conv_kernel", "mlp.type", "mlp.num_experts", "mlp.experts_per_token",
    "mlp.shared_expert.size", "mlp.shared_expert.gate",
)  # fmt: skip
# The sizes whose defaults differ between Qwen3_5TextConfig and Qwen3_5MoeTextConfig.
DEFAULTS = {
    "qwen3_5_text": {"hidden_size": 4096, "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2},
}


def layer_types(c: HFConfig, num_layers: int) -> list[str]:
    """Each layer's kind, as Qwen3_5TextConfig reads it: `layer_types`, else every
    `full_attention_interval`-th layer (default 4) full and the others linear."""
    return c.layer_types(num_layers, "linear_attention", "full_attention_interval", 4)


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a Qwen 3.5 text config.json (defaults as transformers' Qwen3_5TextConfig)."""
    c = HFConfig(hf, where)
    defaults = DEFAULTS.get(hf.get("model_type"), DEFAULTS["qwen3_5_text"])
    mlp = (
        _moe_from_hf(c)
        if hf.get("model_type") == "qwen3_5_moe_text"
        else {"ffn_hidden_size": c.int("intermediate_size", 12288)}
    )
    return build_config(where, family="qwen3_5", **hybrid_fields(c, defaults), **mlp)


def hybrid_fields(c: HFConfig, defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Qwen 3.5 or Qwen3-Next config.json but its MLPs' (their layers, attention
    and norms are the same; `defaults`: the sizes whose defaults differ)."""
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"$.hidden_act: {act!r} is not supported (silu)", c.where)
    layers, trained = (
        c.int("num_hidden_layers", defaults["num_hidden_layers"]),
        c.int("max_position_embeddings", 32768),
    )
    theta, scaling = c.rope(trained=trained, partial=True)
    types = layer_types(c, layers)
    return dict(
        vocab_size=c.int("vocab_size", defaults.get("vocab_size", 248320)),
        hidden_size=c.int("hidden_size", defaults["hidden_size"]),
        num_layers=layers,
        num_heads=c.int("num_attention_heads", 16),
        num_kv_heads=c.int("num_key_value_heads", defaults["num_key_value_heads"]),
        max_seq_len=trained,
        head_dim=c.int("head_dim", 256),
        norm={"type": "rmsnorm_plus1", "eps": c.float("rms_norm_eps", 1e-6)},
        rope={"theta": theta, "scaling": scaling, "partial_rotary_factor": c.partial_rotary(default=0.25)},
        layer_types=types,
        attention={
            "type": "standard",
            "bias": c.bool("attention_bias", False),
            "qk_norm": True,
            "output_gate": True,
        },
        linear_attention=_linear_from_hf(c) if "linear_attention" in types else None,
        tie_embeddings=c.bool("tie_word_embeddings", False),
        bos_id=c.opt_int("bos_token_id"),
        eos_id=c.opt_int("eos_token_id"),
    )


def _moe_from_hf(c: HFConfig) -> dict[str, Any]:
    """Qwen 3.5 MoE's mixture in every layer (defaults as Qwen3_5MoeTextConfig's)."""
    moe = {
        "type": "moe",
        "num_experts": c.int("num_experts", 256),
        "experts_per_token": c.int("num_experts_per_tok", 8),
        "shared_expert": {"size": c.int("shared_expert_intermediate_size", 512), "gate": True},
    }
    return {"ffn_hidden_size": c.int("moe_intermediate_size", 512), "mlp": moe}


def _linear_from_hf(c: HFConfig) -> dict[str, Any]:
    return {
        "type": "gated_deltanet",
        "key_heads": c.int("linear_num_key_heads", 16),
        "value_heads": c.int("linear_num_value_heads", 32),
        "key_head_dim": c.int("linear_key_head_dim", 128),
        "value_head_dim": c.int("linear_value_head_dim", 128),
        "conv_kernel": c.int("linear_conv_kernel_dim", 4),
    }


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    out = hybrid_to_hf(config, "Qwen 3.5") | {
        "architectures": [MOE_ARCHITECTURE if moe else ARCHITECTURE],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
    }
    return out | _moe_to_hf(config) if moe is not None else out


def hybrid_to_hf(config: ModelConfig, name: str) -> dict[str, Any]:
    """The config.json keys Qwen 3.5 and Qwen3-Next (`name`, for the refusal) share: all but the
    architecture and the MLPs'."""
    spec, attention = config.linear_attention, config.attention
    if (
        not isinstance(config.norm, PlusOneRMSNormSpec)
        or not (attention.qk_norm and attention.output_gate)
        or attention.out_bias
    ):
        raise UserError(
            f"{name} has zero-centred norms, q/k norms and an output gate, and no output projection "
            "bias; this config differs",
            "config",
        )
    out = llama_style_to_hf(config) | {
        "hidden_act": "silu",
        "head_dim": config.head_dim,
        "attention_bias": attention.bias,
        "partial_rotary_factor": config.rope.partial_rotary_factor,
        "layer_types": list(config.layer_types or ["full_attention"] * config.num_layers),
    }
    if spec is not None:
        out |= {
            "linear_num_key_heads": spec.key_heads,
            "linear_num_value_heads": spec.value_heads,
            "linear_key_head_dim": spec.key_head_dim,
            "linear_value_head_dim": spec.value_head_dim,
            "linear_conv_kernel_dim": spec.conv_kernel,
        }
    return out


def _moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    shared = moe.shared_expert
    if moe.dense_layers or not moe.router.renormalize_top_k or not (shared and shared.gate):
        raise UserError(
            "Qwen 3.5 MoE has a mixture in every layer, renormalised top-k and a gated shared expert; "
            "this config differs",
            "config",
        )
    return {
        "moe_intermediate_size": config.ffn_hidden_size,
        "shared_expert_intermediate_size": shared.size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
    }


def _inputs(config: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """Qwen 3.5's input projections of a linear layer: q, k and v rows one after the other in
    `in_proj_qkv`, and z, b and a apart."""
    streams = tuple(linear.widths(config)[f"{s}_proj"] for s in linear.CONVOLVED)
    return [
        concatenated(f"{hf}.in_proj_qkv.weight", tuple(f"{ours}.{s}_proj.weight" for s in "qkv"), streams),
        *(rename(f"{hf}.in_proj_{p}.weight", f"{ours}.{p}_proj.weight") for p in "zba"),
    ]


def tensor_maps(
    config: ModelConfig, inputs: Callable[[ModelConfig, str, str], list[TensorMap]] = _inputs
) -> list[TensorMap]:
    """Llama's maps, each layer's attention replaced by its kind's (`_full`, `linear_maps` with the
    linear layer's input projections as `inputs` maps them: Qwen 3.5's by default)."""
    maps = []
    for m in llama.tensor_maps(config):
        ours = m.ours[0]
        if ".attn." not in ours:
            maps.append(m)
        elif linear_layer(config, layer := int(ours.split(".")[1])):
            maps.extend(linear_maps(config, layer, inputs) if ours.endswith("attn.q_proj.weight") else [])
        else:
            maps.append(_full(config, m) if ".attn.q_proj." in ours else m)
    return maps


def _full(config: ModelConfig, q: TensorMap) -> TensorMap:
    """The q projection (weight or bias): each head's q rows, then its output gate's."""
    ours = q.ours[0]
    return per_head(q.hf[0], (ours, ours.replace("q_proj", "gate_proj")), config.num_heads)


def linear_maps(
    config: ModelConfig, layer: int, inputs: Callable[[ModelConfig, str, str], list[TensorMap]]
) -> list[TensorMap]:
    """A linear attention layer's maps: its input projections (`inputs`), then the convolution's
    filters (q's, k's and v's channels one after the other), dt_bias, A_log, the norm and out_proj."""
    hf, ours = f"model.layers.{layer}.linear_attn", f"layers.{layer}.attn"
    streams = tuple(linear.widths(config)[f"{s}_proj"] for s in linear.CONVOLVED)
    return [
        *inputs(config, hf, ours),
        concatenated(f"{hf}.conv1d.weight", tuple(f"{ours}.{s}_conv.weight" for s in "qkv"), streams),
        rename(f"{hf}.dt_bias", f"{ours}.dt_bias.weight"),
        rename(f"{hf}.A_log", f"{ours}.a_log.weight"),
        rename(f"{hf}.norm.weight", f"{ours}.norm.weight"),
        rename(f"{hf}.out_proj.weight", f"{ours}.o_proj.weight"),
    ]


def extra_tensors(config: ModelConfig, names: list[str]) -> tuple[list[str], str | None]:
    """The checkpoint's tensors convert leaves out: the multi-token-prediction module (`mtp.*`) and
    a multimodal checkpoint's vision encoder (`model.visual.*`), and the line that says so."""
    parts = {"the vision encoder": "model.visual.", "the multi-token-prediction module": "mtp."}
    found = {what: [n for n in names if n.startswith(prefix)] for what, prefix in parts.items()}
    said = [f"{what} ({len(left)} tensor{'s' * (len(left) > 1)})" for what, left in found.items() if left]
    if not said:
        return [], None
    left = [n for group in found.values() for n in group]
    return left, f"{' and '.join(said)} left out: the language model is converted, and export writes it alone"
