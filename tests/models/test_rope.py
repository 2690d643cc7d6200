"""RoPE inverse frequencies (and YaRN's attention factor) against transformers' own rope init functions,
with real model settings."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megacore.config import ModelConfig
from megacore.config_parts import RopeScaling, RopeSpec
from megacore.models.rope import attention_scale, inv_freq, rope_tables

# Llama 3.1 8B: head_dim 128, theta 500000 and its llama3 scaling parameters.
THETA, FACTOR, LOW, HIGH, CONTEXT = 500000.0, 8.0, 1.0, 4.0, 8192


def test_llama31_scaling_matches_transformers_in_every_band() -> None:
    """The smooth ramp between the high- and low-frequency wavelengths is where a slip hides: real
    Llama 3.1 settings put several frequencies in it, and all of them (and the kept and the divided
    ones) equal transformers' llama3 init."""
    ours_cfg = ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, max_seq_len=131072,
        rope=RopeSpec(theta=THETA, scaling=RopeScaling(type="llama3", factor=FACTOR, low_freq_factor=LOW,
                                                       high_freq_factor=HIGH, original_max_position_embeddings=CONTEXT)),
    )  # fmt: skip
    hf_cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": THETA, "factor": FACTOR, "low_freq_factor": LOW,
                         "high_freq_factor": HIGH, "original_max_position_embeddings": CONTEXT},
    )  # fmt: skip
    assert ours_cfg.head_dim == 128
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    assert attention_factor == 1.0 and ref.dtype == torch.float32 and ref.shape == (64,)

    unscaled = 1.0 / (THETA ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    wavelen = 2 * math.pi / unscaled
    high_wavelen, low_wavelen = CONTEXT / HIGH, CONTEXT / LOW
    ramp = (wavelen > high_wavelen) & (wavelen < low_wavelen)
    kept, divided = wavelen < high_wavelen, wavelen > low_wavelen
    # The three bands are all populated, so each branch of the formula is compared.
    assert int(ramp.sum()) >= 3 and int(kept.sum()) > 0 and int(divided.sum()) > 0, wavelen
    # The reference really interpolates in the ramp: strictly between freq/factor and freq.
    assert torch.all(ref[ramp] < unscaled[ramp]) and torch.all(ref[ramp] > unscaled[ramp] / FACTOR)

    for seq_len in (16, 8192, 131072):  # llama3 scaling does not depend on the length
        got = inv_freq(ours_cfg, seq_len)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        for band, mask in (("ramp", ramp), ("kept", kept), ("divided", divided)):
            torch.testing.assert_close(
                got[mask],
                ref[mask],
                rtol=1e-6,
                atol=0,
                msg=lambda m, b=band, n=seq_len: f"{b} band, seq {n}: {m}",
            )


# YaRN as published models set it: Qwen 2.5 7B's recommended scaling (head_dim 128, theta 1e6, 32k ->
# 128k), gpt-oss's (theta 150000, head_dim 64, no truncation), DeepSeek-V3's attention factor from
# the mscale pair (factor 40 of 4096), one with narrower betas and one with its own attention factor.
YARN = {
    "qwen2.5": (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    "gpt-oss": (64, 150000.0, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False}),
    "mscale": (128, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                              "mscale_all_dim": 0.707}),
    "betas": (128, 500000.0, {"factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 16.0,
                              "beta_slow": 2.0}),
    "attention-factor": (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 4096,
                                    "attention_factor": 1.3}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_matches_transformers(name: str) -> None:
    """YaRN's inverse frequencies and attention factor equal transformers' own yarn init: every
    frequency bit for bit, kept, divided and blended ones all present; the factor on cos and sin
    exactly, and applied to the tables."""
    head_dim, theta, params = YARN[name]
    heads = 8
    hf_cfg = LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=params["original_max_position_embeddings"] * 4,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params},
    )  # fmt: skip
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, torch.device("cpu"))
    ours_cfg = ModelConfig(
        family="llama", vocab_size=100, hidden_size=heads * head_dim, num_layers=1, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=64, max_seq_len=hf_cfg.max_position_embeddings,
        rope=RopeSpec(theta=theta, scaling=RopeScaling(type="yarn", **params)),
    )  # fmt: skip
    got = inv_freq(ours_cfg, 16)
    assert got.dtype == torch.float32 and torch.equal(got, ref), (got - ref).abs().max()
    unscaled = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kept, divided = ref == unscaled, torch.isclose(ref, unscaled / params["factor"], rtol=1e-6, atol=0)
    assert kept.any() and divided.any() and (~kept & ~divided).any(), name  # all three kinds compared
    assert attention_scale(ours_cfg) == ref_factor and (ref_factor != 1.0)
    cos, sin = rope_tables(ours_cfg, 8, "cpu", torch.float32)
    angles = torch.arange(8, dtype=torch.float32)[:, None] * ref
    torch.testing.assert_close(cos[:, 0, : head_dim // 2], angles.cos() * ref_factor, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0, : head_dim // 2], angles.sin() * ref_factor, rtol=0, atol=0)


def test_rope_scaling_fields_are_checked() -> None:
    """A field the scaling type does not read is refused, and llama3 / yarn need the original context."""
    with pytest.raises(ValueError, match="linear rope scaling has no beta_fast"):
        RopeScaling(type="linear", factor=4.0, beta_fast=32.0)
    with pytest.raises(ValueError, match="yarn rope scaling has no low_freq_factor"):
        RopeScaling(type="yarn", factor=4.0, low_freq_factor=1.0)
    base = {"family": "llama", "vocab_size": 10, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
            "num_kv_heads": 2, "ffn_hidden_size": 8}  # fmt: skip
    with pytest.raises(ValueError, match="yarn needs original_max_position_embeddings"):
        ModelConfig(**base, rope=RopeSpec(scaling=RopeScaling(type="yarn", factor=4.0)))


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
def test_a_factor_below_one_is_refused(kind: str) -> None:
    """A scaling stretches the trained context: a factor below 1 is refused, in a run manifest's
    RopeScaling and in a config.json (naming its field), and 1 is accepted."""
    from megacore.errors import UserError
    from megacore.models import config_from_hf

    with pytest.raises(ValueError, match="factor 0.5 is below 1"):
        RopeScaling(type=kind, factor=0.5, original_max_position_embeddings=64)
    assert RopeScaling(type=kind, factor=1.0).factor == 1.0
    hf = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 4, "intermediate_size": 64,
          "rope_scaling": {"rope_type": kind, "factor": 0.5}}  # fmt: skip
    with pytest.raises(UserError, match=r"config.json: \$.rope_scaling.factor: 0.5 is below 1"):
        config_from_hf(hf, "config.json")


def test_partial_rotary_rotates_the_first_dims_and_is_refused_where_a_family_has_none() -> None:
    """GLM-4.5's partial rotary against transformers' apply_rotary_pos_emb (the rotated first
    `partial_rotary_factor` of each head, the rest passed through); a config.json of a family that
    rotates every dim but asks for less is refused in one line, wherever it puts the factor."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    from megacore.errors import UserError
    from megacore.models import config_from_hf
    from megacore.models.decoder import Attention

    config = ModelConfig(family="glm4_moe", vocab_size=10, hidden_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=4, ffn_hidden_size=8, head_dim=16, rope=RopeSpec(partial_rotary_factor=0.5))  # fmt: skip
    cos, sin = rope_tables(config, 8, "cpu", torch.float32)
    q, k = torch.randn(2, 2, 8, 4, 16).unbind()  # [B, S, heads, head_dim]
    rotate = Attention(config)._rotate
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(1, 2), k.transpose(1, 2), cos[None, :, 0], sin[None, :, 0]
    )
    torch.testing.assert_close(rotate(q, cos, sin), want_q.transpose(1, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotate(k, cos, sin), want_k.transpose(1, 2), rtol=0, atol=1e-6)
    assert cos.shape[-1] == 8 and torch.equal(rotate(q, cos, sin)[..., 8:], q[..., 8:])
    base = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
    for where in (
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    ):
        with pytest.raises(UserError, match=r"^config.json: \$.partial_rotary_factor: a partial rotary"):
            config_from_hf({**base, **where}, "config.json")
    assert config_from_hf({**base, "partial_rotary_factor": 1.0}).rope.partial_rotary_factor == 1.0
