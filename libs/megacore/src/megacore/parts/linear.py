"""The linear attention part (Gated DeltaNet: Qwen 3.5's and Qwen3-Next's "linear_attention"
layers, `config.linear_attention`): q, k, v, the output gate z, the write strength b and the decay
input a projected from the input, a causal convolution's filters per q, k and v channel, the
decay's per-head parameters, a per-head norm of the output and the output projection
(`models.linear_attention`). Tensor parallel splits everything by heads (q and k by key heads,
the rest by value heads; the norm, head_dim wide, replicated; the output projection on its
columns), and what it saves for backward is its own (`saves`): the delta rule keeps its inputs
alone (`models.delta_rule`)."""

from __future__ import annotations

from megacore.config import ModelConfig
from megacore.parts.compute import Compute, Shapes, linear

# The delta rule's chunk (`models.delta_rule.CHUNK`, which imports torch), and what its recomputed
# graph keeps per chunk-padded token and value head (fp32): C-wide rows of C x C matrices and
# key_head_dim-wide vectors, counted from a measured backward.
CHUNK = 64
RECOMPUTED_MATRICES, RECOMPUTED_VECTORS = 6, 8

# The projections, in the module's (and the contract's) order, and the streams the convolution filters.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj")
CONVOLVED = ("q", "k", "v")


def widths(config: ModelConfig) -> dict[str, int]:
    """Each projection's output width, whole: q and k key_heads x key_head_dim, v and z
    value_heads x value_head_dim, b and a one per value head."""
    spec = config.linear_attention
    keys, values = spec.key_heads * spec.key_head_dim, spec.value_heads * spec.value_head_dim
    return dict(
        zip(PROJECTIONS, (keys, keys, values, values, spec.value_heads, spec.value_heads), strict=True)
    )


def tensors(out: Shapes, config: ModelConfig, at: str) -> None:
    """`at`: "layers.<i>.attn"."""
    spec, hidden, width = config.linear_attention, config.hidden_size, widths(config)
    for name in PROJECTIONS:
        linear(out, f"{at}.{name}", width[name], hidden, False)
    for stream in CONVOLVED:
        out[f"{at}.{stream}_conv.weight"] = (width[f"{stream}_proj"], 1, spec.conv_kernel)
    out[f"{at}.dt_bias.weight"] = (spec.value_heads,)
    out[f"{at}.a_log.weight"] = (spec.value_heads,)
    out[f"{at}.norm.weight"] = (spec.value_head_dim,)
    linear(out, f"{at}.o_proj", hidden, width["v_proj"], False)


_TP_DIMS: dict[str, int | None] = {
    **{f"attn.{name}.weight": 0 for name in PROJECTIONS},
    **{f"attn.{stream}_conv.weight": 0 for stream in CONVOLVED},
    "attn.dt_bias.weight": 0, "attn.a_log.weight": 0, "attn.norm.weight": None, "attn.o_proj.weight": 1,
}  # fmt: skip


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    """Layer-relative names -> the dim tp splits (None: replicated)."""
    return _TP_DIMS


def check_tp(config: ModelConfig, tp: int) -> str | None:
    """Why tp cannot split this part by heads (None: it can). The value heads are a multiple of
    the key heads (`GatedDeltaNetSpec`), so tp divides them when it divides the key heads."""
    heads = config.linear_attention.key_heads
    return f"linear_attention.key_heads {heads} is not divisible by tp {tp}" if heads % tp else None


def cache_bytes(config: ModelConfig, tp: int, rows: int, positions: int, c: int) -> int:
    """What a layer's cache holds on a tp rank: the convolution's inputs (q, k and v, every
    position so far, `models.kv_cache`) and the fp32 state, value_heads x key_head_dim x
    value_head_dim a row."""
    spec, width = config.linear_attention, widths(config)
    streams = sum(width[f"{s}_proj"] for s in CONVOLVED) // tp
    return (
        rows * positions * streams * c
        + rows * spec.value_heads // tp * spec.key_head_dim * spec.value_head_dim * 4
    )


def saves(config: ModelConfig, comp: Compute, micro: int, seq: int) -> int:
    """What a linear attention layer saves for backward on a tp rank for `micro` rows of `seq`
    tokens (`models.linear_attention`, measured with saved_tensors_hooks): the projections' output
    (the six are views of one fused matmul's at tp 1, which saves the concatenated weights too),
    each convolution's output (padded by its kernel) and SiLU's, softplus's fp32 input and output,
    g (fp32) and beta, the delta rule's output (in fp32 a view of its chunk-padded result), the
    norm's fp32 statistics and output (in a 2-byte dtype its fp32 copy too), the gate's fp32 SiLU
    and the output projection's input. The delta rule itself keeps only its inputs (counted)."""
    c, tokens, width = comp.c, micro * seq, {k: v // comp.tp for k, v in widths(config).items()}
    spec = config.linear_attention
    heads, values = spec.value_heads // comp.tp, width["v_proj"]
    streams = sum(width[f"{s}_proj"] for s in CONVOLVED)
    projected = tokens * sum(width.values()) * c
    weights = sum(width.values()) * config.hidden_size * c if comp.fast["projections"] else 0
    convolved = micro * (seq + spec.conv_kernel - 1) * streams * c + tokens * streams * c
    decay = tokens * heads * (3 * 4 + c)  # softplus's input and output, g, beta
    padded = micro * -(-seq // CHUNK) * CHUNK if c == 4 else tokens
    rule = padded * values * c
    norm = tokens * heads * 4 + tokens * values * (c + (4 if c < 4 else 0))
    gate = tokens * values * (4 + c)
    return projected + weights + convolved + decay + rule + norm + gate


def recompute_bytes(config: ModelConfig, comp: Compute, micro: int, seq: int) -> int:
    """The delta rule's intermediates while one layer's backward recomputes it (transient, one
    layer at a time): per value head and chunk-padded token, fp32 C x C matrices and head-wide
    vectors, as autograd keeps them for the recomputed graph (`models.delta_rule`)."""
    spec = config.linear_attention
    heads, padded = spec.value_heads // comp.tp, micro * -(-seq // CHUNK) * CHUNK
    return padded * heads * 4 * (RECOMPUTED_MATRICES * CHUNK + RECOMPUTED_VECTORS * spec.key_head_dim)
