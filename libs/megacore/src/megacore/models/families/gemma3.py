"""Gemma 3 text models (Gemma3ForCausalLM, model_type "gemma3_text": Gemma 3 1B and the text
decoders of the larger sizes) as switches of the one decoder:

- RMSNorm of the (1 + weight) kind everywhere (`norm.type` "rmsnorm_plus1"), the per-head q/k
  norms included (`attention.qk_norm`), weights stored as Gemma stores them, so conversion is a
  pure rename;
- four norms per block (`block.sandwich_norm`): input_layernorm -> attn_norm, post_attention_layernorm
  -> attn_post_norm, pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm ->
  mlp_post_norm;
- embeddings times sqrt(hidden_size) in the activations' dtype (`scale_embeddings`);
- GeGLU with GELU's tanh approximation (`activation` "geglu_tanh": hidden_activation
  gelu_pytorch_tanh);
- local and global layers (`layer_types`): the local ones ("sliding_attention") attend through
  `sliding_window` tokens with their own unscaled RoPE base (`rope.local_theta`: transformers 5's
  rope_parameters.sliding_attention, the classic rope_local_base_freq), the global ones with
  `rope.theta` and `rope.scaling` (rope_parameters.full_attention; rope_theta, rope_scaling). Without
  `layer_types` every `sliding_window_pattern`-th layer (6) is global, as Gemma3TextConfig reads it;
- the score scale query_pre_attn_scalar ** -0.5 (`attention.scalar`), an explicit head_dim (256 by
  default, not hidden / heads), tied embeddings by default.

HF layout: model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, pre_feedforward_layernorm, mlp.{gate,up,down}_proj,
post_feedforward_layernorm}, model.norm, lm_head (untied only).

Refused in one line: attention or final-logit softcapping (Gemma 2's; null in Gemma 3), bidirectional
attention, an activation other than gelu_pytorch_tanh, RoPE scaling on the local layers. Defaults
for keys a config.json leaves out are Gemma3TextConfig's. Not modelled: the embedding's
`padding_idx` (pad_token_id), which in transformers keeps the pad row's gradient from the input
side at zero; here that row trains like any other, as for every family.
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig, config_fields
from megacore.errors import UserError
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap, linear, rename

MODEL_TYPES = ("gemma3_text",)
ARCHITECTURE = "Gemma3ForCausalLM"
NAME = "Gemma 3"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Gemma 3 config.json can set to other
# than their defaults (`families.check_expressible` refuses the rest); its norm, activation and
# norm / embedding switches are fixed (`config_to_hf`).
SWITCHES = (
    "head_dim",
    "norm.type",
    "activation",
    "sliding_window",
    "layer_types",
    "rope.local_theta",
    "attention.scalar",
    "attention.bias",
    "attention.out_bias",
    "attention.qk_norm",
    "block.sandwich_norm",
    "scale_embeddings",
)
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATION = "gelu_pytorch_tanh"
# The switches every Gemma 3 sets (of those on SWITCHES), by path (`config_fields`), and their values.
_FIXED = {
    "norm.type": "rmsnorm_plus1",
    "activation": "geglu_tanh",
    "attention.qk_norm": True,
    "block.sandwich_norm": True,
    "scale_embeddings": True,
}


def layer_types(c: HFConfig, num_layers: int) -> list[str]:
    """Each layer's attention, as Gemma3TextConfig reads it: `layer_types`, else every
    `sliding_window_pattern`-th layer (default 6) global and the others sliding."""
    return c.layer_types(num_layers, "sliding_attention", "sliding_window_pattern", 6)


def _refuse_unsupported(c: HFConfig) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.data.get(key) is not None:
            raise UserError(
                f"$.{key}: {c.data[key]!r} is not supported (softcapping; Gemma 3 has none)", c.where
            )
    if c.data.get("use_bidirectional_attention"):
        raise UserError("$.use_bidirectional_attention: only causal attention is supported", c.where)
    act = c.str("hidden_activation", _ACTIVATION)
    if act != _ACTIVATION:
        raise UserError(f"$.hidden_activation: {act!r} is not supported ({_ACTIVATION})", c.where)


def _rope(c: HFConfig) -> tuple[float, Any, float]:
    """(global theta, global scaling, local theta) as Gemma3TextConfig reads them: transformers 5's
    rope_parameters per layer type, the classic keys filling what it leaves out."""
    params = c.data.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= set(_LAYER_TYPES):
        raise UserError(f"$.rope_parameters: expected an object keyed by {list(_LAYER_TYPES)}", c.where)
    full, local = (params.get(t) or {"rope_type": "default"} for t in _LAYER_TYPES)
    for t, p in zip(_LAYER_TYPES, (full, local), strict=True):
        if not isinstance(p, dict):
            raise UserError(f"$.rope_parameters.{t}: expected an object, got {p!r}", c.where)
    classic = c.data.get("rope_scaling") or {}
    if not isinstance(classic, dict):
        raise UserError(f"$.rope_scaling: expected an object, got {classic!r}", c.where)
    full = {**full, **classic}  # transformers puts a classic rope_scaling on the global layers
    full.setdefault("rope_theta", c.data.get("rope_theta", 1_000_000.0))
    key = "rope_parameters.full_attention"
    trained = c.data.get("max_position_embeddings", 131_072)
    theta, scaling = HFConfig({key: full, "max_position_embeddings": trained}, c.where).rope(key)
    if local.get("rope_type", "default") != "default":
        raise UserError(
            f"$.rope_parameters.sliding_attention.rope_type: {local['rope_type']!r} is not supported "
            "(the local layers' RoPE is unscaled)",
            c.where,
        )
    sub = HFConfig(
        {"rope_theta": local.get("rope_theta", c.data.get("rope_local_base_freq", 10_000.0))}, c.where
    )
    return theta, scaling, sub.float("rope_theta")


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    _refuse_unsupported(c)
    layers = c.int("num_hidden_layers")
    types = layer_types(c, layers)
    window = c.data.get("sliding_window", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UserError(f"$.sliding_window: expected a positive integer or null, got {window!r}", where)
    if window is None and "sliding_attention" in types:  # transformers cannot build its mask either
        raise UserError("$.sliding_window: null, but layer_types has sliding_attention layers", where)
    theta, scaling, local_theta = _rope(c)
    bias = c.bool("attention_bias", False)
    return build_config(
        where,
        family="gemma3",
        vocab_size=c.int("vocab_size"),
        hidden_size=c.int("hidden_size"),
        num_layers=layers,
        num_heads=c.int("num_attention_heads"),
        num_kv_heads=c.int("num_key_value_heads", 4),
        ffn_hidden_size=c.int("intermediate_size"),
        max_seq_len=c.int("max_position_embeddings", 131_072),
        norm={"type": "rmsnorm_plus1", "eps": c.float("rms_norm_eps", 1e-6)},
        activation="geglu_tanh",
        head_dim=c.int("head_dim", 256),
        rope={"theta": theta, "scaling": scaling, "local_theta": local_theta},
        sliding_window=window,
        layer_types=types,
        attention={
            "type": "standard",
            "scalar": c.float("query_pre_attn_scalar", 256),
            "bias": bias,
            "out_bias": bias,
            "qk_norm": True,
        },
        block={"type": "sequential", "sandwich_norm": True},
        scale_embeddings=True,
        tie_embeddings=c.bool("tie_word_embeddings", True),
        bos_id=c.opt_int("bos_token_id") if "bos_token_id" in c.data else 2,
        eos_id=c.opt_int("eos_token_id") if "eos_token_id" in c.data else 1,
    )


def _pattern(types: list[str]) -> int | None:
    """The sliding_window_pattern that gives `types` (transformers before layer_types read only it)."""
    n = len(types)
    for p in range(1, n + 2):
        if types == [_LAYER_TYPES[bool((i + 1) % p)] for i in range(n)]:
            return p
    return None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    fields = config_fields(config)
    fixed = [f"{k} {v!r}" for k, v in _FIXED.items() if fields.get(k) != v]
    if fixed:
        raise UserError(f"a Gemma 3 config.json always has {', '.join(fixed)}; this config differs", "config")
    if config.attention.bias != config.attention.out_bias:
        raise UserError("Gemma 3 has one attention bias switch; attention.bias and out_bias differ", "config")
    if config.sliding_window is None or config.rope.local_theta is None:
        raise UserError(
            "Gemma 3 configs need a sliding_window and the local layers' rope.local_theta", "config"
        )
    types = config.layer_types or ["sliding_attention"] * config.num_layers
    scalar = config.attention.scalar if config.attention.scalar is not None else config.head_dim
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "gemma3_text",
        **llama_style_to_hf(config),  # its RoPE: the global layers' (classic form)
        "head_dim": config.head_dim,
        "hidden_activation": _ACTIVATION,
        "rope_local_base_freq": config.rope.local_theta,
        "attention_bias": config.attention.bias,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": config.sliding_window,
        "layer_types": list(types),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    if (pattern := _pattern(types)) is not None:
        out["sliding_window_pattern"] = pattern
    return out


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("model.embed_tokens.weight", "embed.weight")]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        maps.append(rename(f"{hf}.input_layernorm.weight", f"{ours}.attn_norm.weight"))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(maps, f"{hf}.self_attn.{p}", f"{ours}.attn.{p}", config.attention.bias)
        maps.append(rename(f"{hf}.self_attn.q_norm.weight", f"{ours}.attn.q_norm.weight"))
        maps.append(rename(f"{hf}.self_attn.k_norm.weight", f"{ours}.attn.k_norm.weight"))
        maps.append(rename(f"{hf}.post_attention_layernorm.weight", f"{ours}.attn_post_norm.weight"))
        maps.append(rename(f"{hf}.pre_feedforward_layernorm.weight", f"{ours}.mlp_norm.weight"))
        for p in ("gate_proj", "up_proj", "down_proj"):
            linear(maps, f"{hf}.mlp.{p}", f"{ours}.mlp.{p}", False)
        maps.append(rename(f"{hf}.post_feedforward_layernorm.weight", f"{ours}.mlp_post_norm.weight"))
    maps.append(rename("model.norm.weight", "norm.weight"))
    if not config.tie_embeddings:
        maps.append(rename("lm_head.weight", "lm_head.weight"))
    return maps
