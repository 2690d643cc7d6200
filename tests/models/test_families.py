"""The Qwen and Gemma 3 families' config maps, both directions: the sliding-window switches read
as transformers reads them (Qwen: one window on all layers or none, the rest refused in one line;
Gemma 3: local and global layers, a RoPE per layer type, published and transformers 5 forms),
defaults as transformers', and configs a family's config.json cannot express refused on export."""

from __future__ import annotations

import re

import msgspec
import pytest
from transformers import AutoConfig, Gemma3TextConfig

from hf_cases import CASES
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models import config_from_hf, config_to_hf

_QWEN = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
_SLIDING, _FULL = "sliding_attention", "full_attention"

# switches -> the window every layer attends through (None: full attention)
WINDOWS = {
    "off": ({"use_sliding_window": False, "sliding_window": 8}, None),
    "off, published": ({"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28}, None),
    "all layers": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),
    # transformers' default max_window_layers (28) leaves a 4-layer model without sliding layers
    "default layers": ({"use_sliding_window": True, "sliding_window": 8}, None),
    "none past the end": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}, None),
    "layer_types all": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4,
                         "layer_types": [_SLIDING] * 4}, 8),
    "layer_types none": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                          "layer_types": [_FULL] * 4}, None),
}  # fmt: skip

REFUSED = {
    "some layers": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, "2 of 4 layers"),
    "some layer_types": (
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": [_FULL, _SLIDING, _SLIDING, _SLIDING]},
        "3 of 4 layers",
    ),
    "sliding without a window": (
        {"use_sliding_window": False, "layer_types": [_SLIDING] * 4},
        "sliding layers but no window",
    ),
    "unknown layer type": ({"layer_types": [_FULL, _FULL, _FULL, "chunked_attention"]}, "$.layer_types"),
    "bad window": ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0}, "$.sliding_window"),
}  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("what", list(WINDOWS))
def test_sliding_window_switches(model_type: str, what: str) -> None:
    switches, window = WINDOWS[what]
    cfg = config_from_hf({"model_type": model_type, **_QWEN, **switches})
    assert cfg.sliding_window == window
    # Our config.json, read by transformers' own config class, slides on the same layers ...
    hf = AutoConfig.for_model(**config_to_hf(cfg))
    assert hf.model_type == model_type
    assert hf.layer_types == [_SLIDING if window else _FULL] * 4 and hf.sliding_window == window
    # ... and reads back to the same config.
    assert config_from_hf(hf) == cfg


@pytest.mark.parametrize("what", list(REFUSED))
def test_windows_the_decoder_cannot_express_are_refused(what: str) -> None:
    switches, fragment = REFUSED[what]
    with pytest.raises(UserError) as e:
        config_from_hf({"model_type": "qwen2", **_QWEN, **switches}, where="config.json")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_qwen_defaults_as_transformers() -> None:
    """Keys a config.json leaves out take the transformers class's defaults."""
    bare = {k: v for k, v in _QWEN.items() if k != "num_key_value_heads"}
    q2 = config_from_hf({"model_type": "qwen2", **bare, "num_attention_heads": 32, "hidden_size": 256})
    assert (q2.num_kv_heads, q2.head_dim, q2.norm_eps, q2.max_seq_len) == (32, 8, 1e-6, 32768)
    assert (q2.attn_bias, q2.attn_out_bias, q2.mlp_bias, q2.qk_norm) == (True, False, False, False)
    q3 = config_from_hf({"model_type": "qwen3", **_QWEN, "num_key_value_heads": None})
    assert (q3.num_kv_heads, q3.head_dim, q3.qk_norm, q3.attn_bias) == (4, 128, True, False)
    biased = config_from_hf({"model_type": "qwen3", **_QWEN, "attention_bias": True})
    assert biased.attn_bias and biased.attn_out_bias


def _case(name: str) -> ModelConfig:
    cls, kwargs, _ = CASES[name]
    return config_from_hf(cls(**kwargs))


@pytest.mark.parametrize(
    ("case", "changes", "fragment"),
    [
        ("llama3.2", {"qk_norm": True}, "Llama"),
        ("mistral-window", {"qk_norm": True}, "Llama"),
        ("falcon-7b", {"qk_norm": True}, "Falcon"),
        ("qwen2", {"attn_bias": False}, "Qwen 2"),
        ("qwen2", {"attn_out_bias": True}, "Qwen 2"),
        ("qwen2", {"qk_norm": True}, "Qwen 2"),
        ("qwen2", {"mlp_bias": True}, "Qwen 2"),
        ("qwen3", {"qk_norm": False}, "Qwen 3"),
        ("qwen3", {"attn_out_bias": True}, "Qwen 3"),
        ("qwen3", {"norm": "layernorm"}, "Qwen 3"),
    ],
)
def test_export_refuses_what_the_family_cannot_express(case: str, changes: dict, fragment: str) -> None:
    cfg = msgspec.structs.replace(_case(case), **changes)
    with pytest.raises(UserError, match=fragment):
        config_to_hf(cfg)


def test_qwen2_head_dim_written_only_when_explicit() -> None:
    """Published Qwen 2 configs carry no head_dim (hidden / heads); one that differs is written,
    and transformers' Qwen2 attention takes it."""
    cfg = _case("qwen2")
    assert "head_dim" not in config_to_hf(cfg)
    wide = msgspec.structs.replace(cfg, head_dim=32)
    assert AutoConfig.for_model(**config_to_hf(wide)).head_dim == 32
    assert config_from_hf(config_to_hf(wide)) == wide


# --- Gemma 3 ----------------------------------------------------------------------------------------

_GEMMA = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 1, "intermediate_size": 64, "head_dim": 16}  # fmt: skip
# Gemma 3 1B's config.json, as published (transformers 4.50's form), shrunk: classic RoPE keys, the
# global layers' scaling in rope_scaling, every 6th layer global by sliding_window_pattern.
_GEMMA_CLASSIC = {**_GEMMA, "num_hidden_layers": 8, "model_type": "gemma3_text", "rope_theta": 1_000_000.0,
                  "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                  "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                  "attn_logit_softcapping": None}  # fmt: skip


def test_gemma3_maps_both_ways_through_transformers_config() -> None:
    """The test case's Gemma3TextConfig -> ours -> our config.json -> transformers' own class: the
    same layers slide, the same RoPE per layer type, score scale, head_dim and tying, and back to
    the same config."""
    cls, kwargs, _ = CASES["gemma3"]
    source = cls(**kwargs)
    cfg = config_from_hf(source)
    assert (cfg.family, cfg.norm, cfg.activation) == ("gemma3", "rmsnorm_plus1", "geglu_tanh")
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.scale_embeddings and cfg.tie_embeddings
    assert cfg.layer_types == source.layer_types == [_SLIDING, _SLIDING, _FULL, _SLIDING]
    assert (cfg.sliding_window, cfg.head_dim, cfg.attn_scalar) == (8, 32, 24)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.type, cfg.rope_scaling.factor) == (
        5e5,
        20_000.0,
        "linear",
        8.0,
    )
    exported = config_to_hf(cfg)
    hf = AutoConfig.for_model(**exported)
    assert type(hf) is cls and exported["architectures"] == ["Gemma3ForCausalLM"]
    assert hf.layer_types == source.layer_types and hf.sliding_window == source.sliding_window
    assert hf.rope_parameters == source.rope_parameters
    assert (hf.head_dim, hf.query_pre_attn_scalar, hf.tie_word_embeddings) == (32, 24, True)
    assert config_from_hf(hf) == cfg and config_from_hf(exported) == cfg


def test_gemma3_published_config_form_and_defaults() -> None:
    """A published config.json (classic RoPE keys, sliding_window_pattern) reads as transformers
    reads it, and keys a config.json leaves out take Gemma3TextConfig's defaults."""
    cfg = config_from_hf(_GEMMA_CLASSIC)
    assert cfg == config_from_hf(Gemma3TextConfig(**_GEMMA_CLASSIC))
    assert cfg.layer_types == [_SLIDING] * 5 + [_FULL] + [_SLIDING] * 2
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    bare = config_from_hf({"model_type": "gemma3_text", **_GEMMA, "num_hidden_layers": 6})
    assert bare == config_from_hf(Gemma3TextConfig(**{**_GEMMA, "num_hidden_layers": 6}))
    assert (bare.sliding_window, bare.attn_scalar, bare.rope_scaling, bare.norm_eps) == (
        4096,
        256,
        None,
        1e-6,
    )
    assert (bare.rope_theta, bare.local_rope_theta, bare.bos_id, bare.eos_id) == (1e6, 1e4, 2, 1)
    assert bare.layer_types == [_SLIDING] * 5 + [_FULL] and bare.tie_embeddings


GEMMA_REFUSED = {
    "attention softcapping": ({"attn_logit_softcapping": 50.0}, "$.attn_logit_softcapping"),
    "final softcapping": ({"final_logit_softcapping": 30.0}, "$.final_logit_softcapping"),
    "unknown layer type": (
        {"layer_types": [_SLIDING, _FULL, _SLIDING, "chunked_attention"]}, "$.layer_types"
    ),
    "layer type count": ({"layer_types": [_SLIDING, _FULL]}, "$.layer_types: expected 4 entries"),
    "sliding without a window": ({"sliding_window": None}, "$.sliding_window: null"),
    "bidirectional": ({"use_bidirectional_attention": True}, "$.use_bidirectional_attention"),
    "activation": ({"hidden_activation": "gelu"}, "$.hidden_activation"),
    "local rope scaling": (
        {"rope_parameters": {_SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        "$.rope_parameters.sliding_attention.rope_type",
    ),
}  # fmt: skip


@pytest.mark.parametrize("what", list(GEMMA_REFUSED))
def test_gemma3_configs_the_decoder_cannot_express_are_refused(what: str) -> None:
    changes, fragment = GEMMA_REFUSED[what]
    with pytest.raises(UserError) as e:
        config_from_hf({"model_type": "gemma3_text", **_GEMMA, **changes}, where="config.json")
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("case", "changes", "fragment"),
    [
        ("gemma3", {"norm": "rmsnorm"}, "Gemma 3"),
        ("gemma3", {"activation": "swiglu"}, "Gemma 3"),
        ("gemma3", {"sandwich_norm": False}, "Gemma 3"),
        ("gemma3", {"scale_embeddings": False}, "Gemma 3"),
        ("gemma3", {"qk_norm": False}, "Gemma 3"),
        ("gemma3", {"local_rope_theta": None}, "local_rope_theta"),
        # Gemma's switches on other families: their config.json has no key for them.
        ("llama3.2", {"attn_scalar": 24.0}, "Llama config.json cannot express attn_scalar"),
        (
            "mistral-window",
            {"layer_types": [_SLIDING, _FULL]},
            "Mistral config.json cannot express layer_types",
        ),
        ("qwen3", {"sandwich_norm": True, "scale_embeddings": True}, "sandwich_norm, scale_embeddings"),
        ("qwen2", {"local_rope_theta": 1e4}, "Qwen 2 config.json cannot express local_rope_theta"),
        ("falcon-40b", {"scale_embeddings": True}, "Falcon config.json cannot express scale_embeddings"),
        ("llama", {"norm": "rmsnorm_plus1"}, "Llama"),
        ("qwen3", {"activation": "geglu_tanh"}, "Qwen 3"),
    ],
)
def test_gemma3_export_refuses_what_the_config_cannot_express(
    case: str, changes: dict, fragment: str
) -> None:
    cfg = msgspec.structs.replace(_case(case), **changes)
    with pytest.raises(UserError, match=re.escape(fragment)):
        config_to_hf(cfg)
