"""The standard attention part: q, k and v projections (grouped-query: `num_kv_heads` k and v
heads), the output projection, optional per-head q/k norms (`qk_norm`), sinks (`sinks`) and an
output gate (`output_gate`):
`config.attention`, a `StandardAttentionSpec`.
Its tensors, where tensor parallel splits them (by heads: q, k, v and the sinks on their rows, the
output projection on its columns; k and v replicated when there are fewer kv heads than tp), and
what it saves for backward (the planner's terms, `planner.activations`)."""

from __future__ import annotations

from megacore.config import ModelConfig
from megacore.config_parts import PlusOneRMSNormSpec
from megacore.parts import norm
from megacore.parts.compute import Compute, Shapes, linear


def tensors(out: Shapes, config: ModelConfig, at: str) -> None:
    """`at`: "layers.<i>.attn"."""
    hidden, hd, spec = config.hidden_size, config.head_dim, config.attention
    linear(out, f"{at}.q_proj", config.num_heads * hd, hidden, spec.bias)
    linear(out, f"{at}.k_proj", config.num_kv_heads * hd, hidden, spec.bias)
    linear(out, f"{at}.v_proj", config.num_kv_heads * hd, hidden, spec.bias)
    linear(out, f"{at}.o_proj", hidden, config.num_heads * hd, spec.out_bias)
    if spec.output_gate:
        linear(out, f"{at}.gate_proj", config.num_heads * hd, hidden, spec.bias)
    if spec.qk_norm:
        out[f"{at}.q_norm.weight"] = (hd,)
        out[f"{at}.k_norm.weight"] = (hd,)
    if spec.sinks:
        out[f"{at}.sinks.weight"] = (config.num_heads,)


def kv_replicated(config: ModelConfig, tp: int) -> bool:
    """k/v projections are replicated over tp (not split) when there are fewer kv heads than tp."""
    return config.num_kv_heads < tp


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    """Layer-relative names -> the dim tp splits (None: replicated). The per-head q/k norms are
    replicated: each rank applies the same head_dim-wide weight to its own heads."""
    kv = None if kv_replicated(config, tp) else 0
    return {
        "attn.q_proj.weight": 0, "attn.q_proj.bias": 0,
        "attn.k_proj.weight": kv, "attn.k_proj.bias": kv,
        "attn.v_proj.weight": kv, "attn.v_proj.bias": kv,
        "attn.o_proj.weight": 1, "attn.o_proj.bias": None,
        "attn.gate_proj.weight": 0, "attn.gate_proj.bias": 0,
        "attn.q_norm.weight": None, "attn.k_norm.weight": None,
        "attn.sinks.weight": 0,
    }  # fmt: skip


def kv_width(config: ModelConfig, tp: int) -> int:
    """The width of a tp rank's k (and v) after the projection: its kv heads x head_dim, one head
    where they are replicated (fewer kv heads than tp)."""
    if tp == 1:
        return config.num_kv_heads * config.head_dim
    return config.head_dim * (1 if kv_replicated(config, tp) else config.num_kv_heads // tp)


def cache_bytes(config: ModelConfig, tp: int, rows: int, positions: int, c: int) -> int:
    """What a layer's KV cache (`models.kv_cache`) holds on a tp rank for `rows` rows of
    `positions` positions in the compute dtype's `c` bytes: its k and v."""
    return 2 * rows * positions * kv_width(config, tp) * c


def saves(
    config: ModelConfig, comp: Compute, tokens: int, heads: int, kv: int, keys: int
) -> tuple[int, int, int, int]:
    """(what attention saves before its kernel, o_proj's input, at tp 1 the fused q/k/v matmul's
    concatenated weights, the kernel's output: o_proj's input is a copy of it), for `tokens` tokens
    of `heads` q heads and `kv`-wide k and v (tp-local); under cp the gathered keys are
    `cp_gathered`'s. An output gate (`output_gate`) adds its sigmoid and the gated product (and,
    fused, its part of the projection output and its weights)."""
    c, h, q = comp.c, config.hidden_size, heads * config.head_dim
    gated = config.attention.output_gate
    if comp.fast["projections"]:  # fused q/k/v: v is a view of the projection output, alive whole
        gate = 3 * tokens * q * c if gated else 0
        weights = (q + 2 * kv + (q if gated else 0)) * h * c
        return tokens * (2 * q + 3 * kv) * c + gate, tokens * q * c, weights, tokens * q * c
    # kv heads replicated: this rank's head is a view of the whole v projection output
    v = config.num_kv_heads * config.head_dim if kv_replicated(config, comp.tp) else kv
    gate = 2 * tokens * q * c if gated else 0
    return tokens * (q + kv + v) * c + gate, tokens * q * c, 0, tokens * q * c


def head_norm_saves(config: ModelConfig, comp: Compute, tokens: int, heads: int, kv: int) -> int:
    """The per-head q/k norms' (qk_norm): their fp32 rstd per head, and with unfused projections
    their inputs (the projections' outputs, otherwise freed by RoPE; fused, views of the kept q/k/v)."""
    if not config.attention.qk_norm:
        return 0
    hd = config.head_dim
    total = tokens * (heads + kv // hd) * 4
    if not comp.fast["projections"]:
        head_in = tokens * (heads * hd + kv) * comp.c
        plain = not comp.fast["head_norms"] and isinstance(config.norm, PlusOneRMSNormSpec)
        total += head_in + (norm.plain_extra(config, head_in, comp.c) if plain else 0)
    return total


def cp_gathered(config: ModelConfig, micro: int, seq: int, kv: int, c: int) -> int:
    """Context parallel's all-gathered k and v of the whole sequence, which SDPA keeps slices of."""
    return 2 * micro * seq * kv * c


def sink_saves(config: ModelConfig, comp: Compute, micro: int, local: int, heads: int) -> int:
    """What attention with sinks (gpt-oss, `models.sinks`) saves on a GPU, where no fused kernel has
    a sink: the fp32 scores' softmax with the sink column [micro, heads, S, S + 1], the probabilities
    in the compute dtype (in fp32 a view of it), q and k in fp32 and v (the GQA-repeated heads),
    copied by the matmuls, and the S x S boolean mask. Its output, a matmul's, is not saved; nor
    are rotated q and k, or the q/k/v projection's output (on a CPU the sink kernel saves SDPA's
    tensors instead, and an additive mask: less)."""
    c, hd, tokens = comp.c, config.head_dim, micro * local
    scores = micro * heads * local * (local + 1) * 4 + (micro * heads * local * local * c if c < 4 else 0)
    return scores + tokens * heads * hd * (8 + c) + local * local
