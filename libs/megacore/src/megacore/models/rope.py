"""Rotary position embeddings (half-rotation convention, as in Hugging Face Llama/Mistral/Falcon).

The tables are computed in forward from (config, seq_len), never stored as buffers: a model built on
the meta device or cut into pipeline stages needs no re-initialisation, and dynamic NTK scaling
(which depends on the sequence length) is a pure function of it.
The float32 arithmetic mirrors transformers' `modeling_rope_utils` so that fp32 logits agree to ~1e-6:
every scaling type (`RopeScaling`: linear, dynamic, llama3, yarn) computes its inverse frequencies as
transformers' rope init function of that type does, and YaRN's attention factor scales cos and sin
(`attention_scale`), as transformers' rotary embedding does with the factor its init returns.
"""

from __future__ import annotations

import math

import torch

from megacore.config import ModelConfig, rope_dim
from megacore.config_parts import RopeScaling


def inv_freq(
    config: ModelConfig, seq_len: int, device: torch.device | str | None = None, local: bool = False
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for a sequence of `seq_len` positions; `local`:
    the sliding layers' own RoPE (`rope.local_theta`, unscaled: Gemma 3's local layers)."""
    dim = rope_dim(config)
    base = config.rope.local_theta if local else config.rope.theta
    scaling = None if local else config.rope.scaling
    if scaling is not None and scaling.type == "dynamic":
        # Dynamic NTK: stretch the base only once the sequence outgrows the trained context.
        trained = scaling.original_max_position_embeddings or config.max_seq_len
        if seq_len > trained:
            base = base * ((scaling.factor * seq_len / trained) - (scaling.factor - 1)) ** (dim / (dim - 2))
    if scaling is not None and scaling.type == "yarn":
        return _yarn(scaling, base, dim, device)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    freqs = 1.0 / (base**exponents)
    if scaling is None or scaling.type == "dynamic":
        return freqs
    if scaling.type == "linear":
        return freqs / scaling.factor
    return _llama3(
        freqs,
        scaling.factor,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_max_position_embeddings,
    )


def _llama3(freqs: torch.Tensor, factor: float, low: float, high: float, context: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(scaling: RopeScaling, base: float, dim: int, device: torch.device | str | None) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters`: a frequency that turns
    more than `beta_fast` times over the original context is kept, one that turns fewer than
    `beta_slow` times is divided by `factor`, and those between are blended along a linear ramp over
    the dimensions (its ends rounded outwards unless `truncate` is false)."""
    fast, slow = scaling.beta_fast or 32, scaling.beta_slow or 1
    context = scaling.original_max_position_embeddings
    assert context is not None  # RopeSpec requires it for yarn

    def dimension(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return (dim * math.log(context / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


def attention_scale(config: ModelConfig, local: bool = False) -> float:
    """The factor on cos and sin (attention scores scale by its square): YaRN's `attention_factor`,
    given or transformers' default (0.1 ln(factor) + 1, or that form with `mscale` over it with
    `mscale_all_dim` when both are set); 1 for every other RoPE, and for the local layers'."""
    scaling = None if local else config.rope.scaling
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return float(
            _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor, scaling.mscale_all_dim)
        )
    return _mscale(scaling.factor)


def _mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale (transformers' `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def latent_attention_scale(config: ModelConfig) -> float:
    """Latent attention's score scale: head_dim ** -0.5, under YaRN times mscale(factor,
    mscale_all_dim) squared (DeepSeek's softmax_scale; transformers' `yarn_apply_mscale`)."""
    scale = config.head_dim**-0.5
    s = config.rope.scaling
    if s is not None and s.type == "yarn" and s.mscale_all_dim:
        m = _mscale(s.factor, s.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_tables(
    config: ModelConfig,
    seq_len: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
    local: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [seq_len, 1, head_dim] in `dtype`, broadcastable over [B, S, heads, head_dim];
    with `positions` [B, S] (packed documents, each counted from 0), [B, S, 1, head_dim]. `local`:
    the sliding layers' tables (`inv_freq`). Both are scaled by `attention_scale` (YaRN's)."""
    freqs = inv_freq(config, seq_len, device, local)
    pos = torch.arange(seq_len, device=device) if positions is None else positions
    angles = pos.to(torch.float32)[..., None] * freqs  # the outer product, batched
    emb = torch.cat((angles, angles), dim=-1)[..., None, :]
    cos, sin = emb.cos(), emb.sin()
    scale = attention_scale(config, local)
    if scale != 1.0:  # in float32, before the cast, as transformers
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, heads, head_dim] by the tables from `rope_tables`.

    Same result as transformers' `x * cos + rotate_half(x) * sin`, written as a rotation of the two
    halves into one output buffer: no rotate_half copy, no neg/cat, and a backward that is the inverse
    rotation (about half the elementwise traffic of autograd through the composite form).

    `bench/run.py kernels` (CPU, 2 threads, x 1 x 4096 x 32 heads x 128, two runs): forward+backward
    0.39-0.41x the time of the composite form in fp32 and 0.67-0.87x in bf16, not counting the
    heads-major output layout that saves SDPA a copy. It pays in both."""
    if torch.compiler.is_compiling():  # the compiler fuses the composite form on its own
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin
    return _Rope.apply(x, cos, sin)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float, heads_major: bool
) -> torch.Tensor:
    h = x.shape[-1] // 2
    c, s = cos[..., :h], sin[..., :h]
    x1, x2 = x[..., :h], x[..., h:]
    if heads_major:
        # [B, S, H, D] view of [B, H, S, D] memory: what SDPA's CPU kernel reads fastest (its
        # transposed view is contiguous), produced here for free instead of by a later copy.
        b, seq, heads, d = x.shape
        out = x.new_empty(b, heads, seq, d).transpose(1, 2)
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-sign)  # x1 cos - x2 sin
    torch.mul(x2, c, out=o2).addcmul_(x1, s, value=sign)  # x2 cos + x1 sin
    return out


class _Rope(torch.autograd.Function):
    """`apply_rope`'s eager path (what the benchmark shows it saves: `apply_rope`'s docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0, heads_major=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0, heads_major=False), None, None
