"""The Qwen families' config maps, both directions: the sliding-window switches read as
transformers reads them (one window on all layers or none; the rest refused in one line), Qwen
defaults, and configs a family's config.json cannot express refused on export."""

from __future__ import annotations

import msgspec
import pytest
from transformers import AutoConfig

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
