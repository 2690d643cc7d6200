"""The latent attention part (DeepSeek V2/V3's multi-head latent attention, `attention` type latent): k
and v expanded per head from one normed latent, q through its own low-rank pair (`q_lora_rank`) or
one projection, the rope part of q and k rotated (k's shared by every head). Its tensors, where
tensor parallel splits them (the per-head expansions by heads like q, the output projection on its
columns, the latent projections and their norms replicated), and what it saves for backward."""

from __future__ import annotations

from megacore.config import ModelConfig
from megacore.parts.compute import Compute, Shapes


def tensors(out: Shapes, config: ModelConfig, at: str) -> None:
    """`at`: "layers.<i>.attn": q's projection (or low-rank pair and its norm), the latent's
    projection (its rope part last), norm and expansion, the output."""
    hidden, heads, hd = config.hidden_size, config.num_heads, config.head_dim
    la = config.latent
    if la.q_lora_rank is None:
        out[f"{at}.q_proj.weight"] = (heads * hd, hidden)
    else:
        out[f"{at}.q_a_proj.weight"] = (la.q_lora_rank, hidden)
        out[f"{at}.q_a_norm.weight"] = (la.q_lora_rank,)
        out[f"{at}.q_b_proj.weight"] = (heads * hd, la.q_lora_rank)
    latent, nope = la.kv_lora_rank, hd - la.qk_rope_head_dim
    out[f"{at}.kv_a_proj.weight"] = (latent + la.qk_rope_head_dim, hidden)
    out[f"{at}.kv_a_norm.weight"] = (latent,)
    out[f"{at}.kv_b_proj.weight"] = (heads * (nope + la.v_head_dim), latent)
    out[f"{at}.o_proj.weight"] = (hidden, heads * la.v_head_dim)


_TP_DIMS: dict[str, int | None] = {
    "attn.q_proj.weight": 0, "attn.q_b_proj.weight": 0, "attn.kv_b_proj.weight": 0,
    "attn.o_proj.weight": 1,
    "attn.q_a_proj.weight": None, "attn.q_a_norm.weight": None,
    "attn.kv_a_proj.weight": None, "attn.kv_a_norm.weight": None,
}  # fmt: skip


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    """Layer-relative names -> the dim tp splits (None: replicated)."""
    return _TP_DIMS


def _latent_norm(comp: Compute, tokens: int, width: int, stored: int) -> int:
    """What one of latent attention's RMSNorms (`width` wide) saves, with the output its expansion
    reads: its input, a view keeping the projection output's whole `stored` width alive, and the fp32
    rstd; under tp (plain nn.RMSNorm) an fp32 normalised input besides, and in a 2-byte dtype the
    input's fp32 copy in the view's place (measured with saved_tensors_hooks)."""
    c = comp.c
    out = tokens * 4 + tokens * width * c
    if comp.fast["head_norms"]:
        return out + tokens * stored * c
    return out + (tokens * stored * c if c == 4 else tokens * width * 4) + tokens * width * 4


def _before_kernel(config: ModelConfig, comp: Compute, tokens: int, heads: int, keys: int) -> int:
    """What latent attention (`LatentAttention`) saves before its kernel: the latent norms' inputs,
    statistics and outputs (kv_a_proj's latent + rope output, q_a_proj's q_lora_rank one), and the
    kernel's q, k and v, each tp-local heads x head_dim (v padded to it; a v as wide as q's heads is
    instead a view keeping kv_b_proj's whole nope + v output). k and v span `keys` tokens: the
    rank's own, or under cp the whole rows', expanded from the gathered normed latent and rotated k
    (latent + rope wide, kept whole by kv_b_proj's input, a view of it) in place of the rank's own
    normed latent."""
    la = config.latent
    c, hd, v, rope = comp.c, config.head_dim, la.v_head_dim, la.qk_rope_head_dim
    latent, q_lora = la.kv_lora_rank, la.q_lora_rank
    total = _latent_norm(comp, tokens, latent, latent + rope)
    if keys != tokens:
        total += (keys * (latent + rope) - tokens * latent) * c
    if q_lora is not None:
        total += _latent_norm(comp, tokens, q_lora, q_lora)
    v_kept = heads * hd if v < hd else heads * (hd - rope + v)
    return total + (tokens * heads * hd + keys * (heads * hd + v_kept)) * c


def saves(
    config: ModelConfig, comp: Compute, tokens: int, heads: int, kv: int, keys: int
) -> tuple[int, int, int, int]:
    """(what it saves before its kernel, o_proj's input, 0: no fused projections, the kernel's
    output). Its v as wide as q's heads: the output (q, a cat, lays it out [b, s, heads, d]) and
    o_proj's input, a view of it, counted once, as o_proj's input; a narrower v is sliced out of it."""
    hd, v = config.head_dim, config.latent.v_head_dim
    out = tokens * heads * hd * comp.c if v < hd else 0
    return _before_kernel(config, comp, tokens, heads, keys), tokens * heads * v * comp.c, 0, out


def head_norm_saves(config: ModelConfig, comp: Compute, tokens: int, heads: int, kv: int) -> int:
    """0: latent attention has no per-head q/k norms (its latent norms are counted in `saves`)."""
    return 0


def cache_bytes(config: ModelConfig, tp: int, rows: int, positions: int, c: int) -> int:
    """What a layer's KV cache holds: the normed latent and the rotated k every head shares, whole
    on every tp rank (k and v are expanded from them each step)."""
    la = config.latent
    return rows * positions * (la.kv_lora_rank + la.qk_rope_head_dim) * c


def cp_gathered(config: ModelConfig, micro: int, seq: int, kv: int, c: int) -> int:
    """0: the whole rows' k and v are the kernel's inputs, counted in `saves`."""
    return 0
