"""RoPE inverse frequencies against transformers' own rope init functions, with real model settings."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megacore.config import ModelConfig, RopeScaling
from megacore.models.rope import inv_freq

# Llama 3.1 8B: head_dim 128, theta 500000 and its llama3 scaling parameters.
THETA, FACTOR, LOW, HIGH, CONTEXT = 500000.0, 8.0, 1.0, 4.0, 8192


def test_llama31_scaling_matches_transformers_in_every_band() -> None:
    """The smooth ramp between the high- and low-frequency wavelengths is where a slip hides: real
    Llama 3.1 settings put several frequencies in it, and all of them (and the kept and the divided
    ones) equal transformers' llama3 init."""
    ours_cfg = ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, max_seq_len=131072, rope_theta=THETA,
        rope_scaling=RopeScaling(type="llama3", factor=FACTOR, low_freq_factor=LOW, high_freq_factor=HIGH,
                                 original_max_position_embeddings=CONTEXT),
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
