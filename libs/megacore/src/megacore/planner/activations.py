"""The planner's activations model: what autograd saves for backward on a rank during a training
step, op by op (the `Decoder`'s ops as `ParallelModel` builds them), and how many microbatches a
pipeline rank holds at its peak.

Sizes are bytes; S = sequence length, T = micro batch x S / cp tokens per microbatch (a
context-parallel rank holds S / cp tokens of each row, `parallel/cp.py`), c = bytes of the compute
dtype (4 fp32, 2 bf16/fp16), "tp-local" = the part `place`/`tp_box` give a tp rank, kv = the
tp-local width of k (kv heads x head_dim; one head where tp replicates them).

What is counted (tests/train/test_planner.py measures a step on CPU):
- per layer and microbatch, recompute none: the inputs of the norms (T·h·c each, /tp with sequence
  parallel, plus their fp32 statistics), the norm outputs the projections read (T·h·c), rotated q
  and k, v (with the fused q/k/v matmul at tp 1, v is a view of the whole projection output, which
  stays alive: T·(q+2kv)·c), the attention output and the o_proj input (a copy of it), the
  log-sum-exp (fp32), the MLP's gate, up, silu and product (4·T·f/tp·c; GELU: 2), and at tp 1 the
  concatenated q/k/v and gate/up weights the fused matmuls save (GeGLU as SwiGLU); per-head q/k
  norms (qk_norm) their fp32 statistics, and at tp > 1 their inputs; sandwich norms (Gemma) the
  attention's and the MLP's outputs they normalise, and their statistics. Gemma's (1 + w) RMSNorm
  saves what the fused RMSNorm does; where it runs as plain ops (on a sequence shard, a q/k norm
  at tp > 1) its fp32 input and fp32 normalised input. A sliding window shorter than the sequence
  adds the S x S mask SDPA saves (not with flash-attn), on the layers that slide
  (`attention_window`). Latent attention (DeepSeek V3, `kv_lora_rank`) instead of q/k/v: kv_a_proj's
  output (latent + rope wide, whole on every tp rank: its norm's input is a view of it), q_a_proj's
  (q_lora_rank), their norms' fp32 statistics and outputs (under tp plain nn.RMSNorm, with an fp32
  normalised input besides, and in a 2-byte dtype an fp32 copy of the input for it), q and k of
  heads x head_dim, v padded to head_dim, the kernel's head_dim-wide output, o_proj's input of
  heads x v_head_dim. Attention sinks (gpt-oss) on a GPU: the fp32 scores' softmax, the
  probabilities, copies of q, k and v and a boolean mask, S x S per head, not SDPA's tensors
  (`_sink_attention`; context parallel's chunks are sized as without sinks). The MLP's tensors
  ffn wide by the activation (`MLP_SAVES`: gpt-oss's clamped SwiGLU 7). selective: without the attention kernel's output and log-sum-exp (its
  kernels keep no S x S matrix to drop). full: the block's input only, plus one layer's recompute at
  the peak of the backward.
- context parallel (cp > 1): all of the above for the rank's T tokens; attention adds the whole
  sequence's k and v, all-gathered per layer (2·micro·S·kv·c, SDPA keeping slices of them) and,
  with a window shorter than a chunk's keys (not with flash-attn), that chunk's mask against the
  keys up to its end (S/2cp x end), on the fullest rank, instead of the S x S one (on a CPU a late
  chunk without a window materialises one too: not counted; on a GPU none).
  Selective recompute drops both (the cp kernel reruns whole, its all-gather included). Latent
  attention gathers its normed latent and rotated k instead and expands the whole rows' k and v
  from them: those and its k and v are counted over the whole rows (S x micro), q over the rank's.
- per stage: token ids (first), the RoPE tables (twice with Gemma 3's local ones; cos and sin
  [S, hd], latent attention's its rope dims wide; under cp per row: [micro, S / cp, hd], as cp
  gives positions), the final norm and the loss (last: the fused loss saves the hidden-state and weight gradients; vocab-parallel logits
  keep their fp32 log-softmax, and a pipeline's last stage keeps its logits too), a pipeline
  stage's output (kept until its backward).
- in flight (`in_flight`): microbatch-chunks a pipeline rank holds at its peak, from the schedules'
  own warmup counts: 1 without a pipeline (gradient accumulation runs microbatches one by one);
  GPipe all m of them; 1F1B min(m, pp - rank), so pp on the first stage; interleaved 1F1B
  min(m·v, (v-1)·r + 2·(pp-1-rank) + 1) chunks of one local stage, r = m / max(1, m // pp)
  microbatches per round (interleaved zero bubble: 1 instead of 2 per hop, its deferred weight
  gradients not counted); ZB-V min(2m, 2·pp).
How close it comes to a measured step: `megacore.planner.memory`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megacore.config import (
    GATED_ACTIVATIONS,
    ModelConfig,
    attention_window,
    local_rope,
    mlp_width,
    rope_dim,
    sparse_layer,
)
from megacore.parallel.build_rules import fast_paths, fused_loss
from megacore.parallel.dims import Parallelism
from megacore.parallel.layout import check_parallelism, kv_replicated

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 but the float8 matmuls


def sequence_shards(par: Parallelism) -> int:
    """The parts sequence parallel cuts the residual stream into: tp with sequence parallel."""
    return par.spec.tp if par.spec.sequence_parallel and par.spec.tp > 1 else 1


def _norm_stat(config: ModelConfig) -> int:
    """Bytes per token of a norm's fp32 statistics: RMSNorm's rstd; LayerNorm's mean and rstd."""
    return 8 if config.norm == "layernorm" else 4


def _plain_norm_extra(config: ModelConfig, saved: int, c: int) -> int:
    """Bytes a norm running as plain ops (on a sequence shard) saves beyond its input of `saved`
    bytes: nn.RMSNorm its normalised input (measured); Gemma's (1 + w) RMSNorm its fp32 normalised
    input and, in a 2-byte dtype, an fp32 copy of the input in the input's place."""
    if config.norm == "rmsnorm":
        return saved
    if config.norm == "rmsnorm_plus1":
        return saved * 4 // c + saved * (4 - c) // c
    return 0


def kv_width(config: ModelConfig, tp: int) -> int:
    """The width of a tp rank's k (and v) after the projection: its kv heads x head_dim, one head
    where they are replicated (fewer kv heads than tp)."""
    if tp == 1:
        return config.num_kv_heads * config.head_dim
    return config.head_dim * (1 if kv_replicated(config, tp) else config.num_kv_heads // tp)


def _cp_attention(
    config: ModelConfig, par: Parallelism, micro: int, seq: int, kv: int, layer: int, attention: str
) -> int:
    """What context parallel's attention saves beyond a sequence of seq / cp (`cp.py`): the whole
    sequence's k and v (`kv` wide, tp-local), gathered once per layer, which SDPA keeps slices of;
    with a window shorter than a chunk's keys, that chunk's mask of its n = seq / 2cp queries against
    the keys up to its end, converted to an additive one in the compute dtype as SDPA saves it
    (none with flash-attn). Rank r's chunks r and 2cp-1-r end at (r+1)·n and (2cp-r)·n; the fullest
    rank counts."""
    cp, c = par.spec.cp, COMPUTE_BYTES[par.precision]
    # Latent attention's whole k and v are the kernel's inputs (`_latent_attention`), not its gather's.
    gathered = 2 * micro * seq * kv * c if config.kv_lora_rank is None else 0
    window, n = attention_window(config, layer), seq // (2 * cp)
    if window is None or attention == "flash":
        return gathered
    ends = [((r + 1) * n, (2 * cp - r) * n) for r in range(cp)]
    return gathered + max(sum(n * end * c for end in pair if end > window) for pair in ends)


# Tensors ffn wide a gated MLP saves per token (gate and up, then the activation's): SwiGLU and
# GeGLU the activated gate and the product; gpt-oss's clamped SwiGLU the clamped gate, its sigmoid,
# their product, up + 1 and the product (measured with saved_tensors_hooks). GELU: up and gelu(up).
MLP_SAVES = {"swiglu": 4, "geglu_tanh": 4, "clamped_swiglu": 7, "gelu": 2}


def _moe_activations(config: ModelConfig, tokens: int, c: int, tp: int) -> int:
    """What a mixture-of-experts MLP saves (models/moe.py): each routed (token, expert) row's input,
    its gated MLP's tensors (`MLP_SAVES`, tp-local: each expert's ffn is split over tp), its output
    before the routing weight and after it (in the compute dtype: `index_add_` keeps its source for
    backward, torch 2.13; found by tests/families/test_conformance.py); the router's logits and fp32
    probabilities, and the int64 indices and fp32 weights of the top-k choices."""
    routed, experts = tokens * config.experts_per_token, config.num_experts
    h, f = config.hidden_size, config.ffn_hidden_size // tp
    glu = MLP_SAVES[config.activation] * f
    return routed * (glu + 3 * h) * c + tokens * experts * (c + 4) + routed * (2 * 8 + 2 * 4)


def _sink_attention(config: ModelConfig, par: Parallelism, micro: int, local: int, heads: int) -> int:
    """What attention with sinks (gpt-oss, `models.sinks`) saves on a GPU, where no fused kernel has
    a sink: the fp32 scores' softmax with the sink column [micro, heads, S, S + 1], the probabilities
    in the compute dtype (in fp32 a view of it), q and k in fp32 and v (the GQA-repeated heads),
    copied by the matmuls, and the S x S boolean mask. Its output, a matmul's, is not saved; nor
    are rotated q and k, or the q/k/v projection's output (on a CPU the sink kernel saves SDPA's
    tensors instead, and an additive mask: less)."""
    c, hd, tokens = COMPUTE_BYTES[par.precision], config.head_dim, micro * local
    scores = micro * heads * local * (local + 1) * 4 + (micro * heads * local * local * c if c < 4 else 0)
    return scores + tokens * heads * hd * (8 + c) + local * local


def _norm_activations(config: ModelConfig, par: Parallelism, tokens: int, heads: int, kv: int) -> int:
    """What a block's norms save: their inputs and fp32 statistics, the outputs the projections
    read, and where they run as plain ops (`build_rules.fast_paths`) what those save besides."""
    c, sp, h, hd = COMPUTE_BYTES[par.precision], sequence_shards(par), config.hidden_size, config.head_dim
    fast = fast_paths(par)
    residual = math.ceil(tokens / sp) * h * c
    norm_in = 1 if config.parallel_attn else 2  # a parallel block's norms share their input
    if config.sandwich_norm:  # the attention's and the MLP's outputs, normed before the residual add
        norm_in += 2
    # Norm outputs the projections read; with sequence parallel each of attention and MLP gathers its own.
    norm_out = 1 if config.parallel_attn and config.num_ln_in_parallel_attn == 1 and sp == 1 else 2
    norms = norm_in * (residual + math.ceil(tokens / sp) * _norm_stat(config)) + norm_out * tokens * h * c
    if not fast["norms"]:  # measured: nn.RMSNorm on a sequence shard saves its normalised input
        # too, and a block one more shard besides
        norms += norm_in * _plain_norm_extra(config, residual, c) + residual
    if config.qk_norm:  # per-head q/k norms: their fp32 rstd per head, and with unfused projections
        # their inputs (the projections' outputs, otherwise freed by RoPE; fused, views of the kept q/k/v)
        norms += tokens * (heads + kv // hd) * 4
        if not fast["projections"]:
            head_in = tokens * (heads * hd + kv) * c
            plain = not fast["head_norms"] and config.norm == "rmsnorm_plus1"
            norms += head_in + (_plain_norm_extra(config, head_in, c) if plain else 0)
    return norms


def _latent_norm(par: Parallelism, tokens: int, width: int, stored: int) -> int:
    """What one of latent attention's RMSNorms (`width` wide) saves, with the output its expansion
    reads: its input, a view keeping the projection output's whole `stored` width alive, and the fp32
    rstd; under tp (plain nn.RMSNorm) an fp32 normalised input besides, and in a 2-byte dtype the
    input's fp32 copy in the view's place (measured with saved_tensors_hooks)."""
    c = COMPUTE_BYTES[par.precision]
    out = tokens * 4 + tokens * width * c
    if fast_paths(par)["head_norms"]:
        return out + tokens * stored * c
    return out + (tokens * stored * c if c == 4 else tokens * width * 4) + tokens * width * 4


def _latent_attention(config: ModelConfig, par: Parallelism, tokens: int, heads: int, keys: int) -> int:
    """What latent attention (`LatentAttention`) saves before its kernel: the latent norms' inputs,
    statistics and outputs (kv_a_proj's latent + rope output, q_a_proj's q_lora_rank one), and the
    kernel's q, k and v, each tp-local heads x head_dim (v padded to it; a v as wide as q's heads is
    instead a view keeping kv_b_proj's whole nope + v output). k and v span `keys` tokens: the
    rank's own, or under cp the whole rows', expanded from the gathered normed latent and rotated k
    (latent + rope wide, kept whole by kv_b_proj's input, a view of it) in place of the rank's own
    normed latent."""
    c, hd, v, rope = COMPUTE_BYTES[par.precision], config.head_dim, config.v_head_dim, config.qk_rope_head_dim
    latent, q_lora = config.kv_lora_rank, config.q_lora_rank
    total = _latent_norm(par, tokens, latent, latent + rope)
    if keys != tokens:
        total += (keys * (latent + rope) - tokens * latent) * c
    if q_lora is not None:
        total += _latent_norm(par, tokens, q_lora, q_lora)
    v_kept = heads * hd if v < hd else heads * (hd - rope + v)
    return total + (tokens * heads * hd + keys * (heads * hd + v_kept)) * c


def _attention(
    config: ModelConfig, par: Parallelism, tokens: int, heads: int, kv: int, keys: int
) -> tuple[int, int, int, int]:
    """What attention saves before its kernel, o_proj's input, at tp 1 the fused q/k/v matmul's
    concatenated weights, and the kernel's output: o_proj's input is a copy of it, but for latent
    attention's v as wide as q's heads (its q, a cat, lays the output out [b, s, heads, d], and the
    reshape is a view of it: counted once, as o_proj's input); a narrower v is sliced out of it."""
    c, tp, h, hd = COMPUTE_BYTES[par.precision], par.spec.tp, config.hidden_size, config.head_dim
    q = heads * hd
    if config.kv_lora_rank is not None:  # latent attention: no fused projections
        v = config.v_head_dim
        out = tokens * q * c if v < hd else 0
        return _latent_attention(config, par, tokens, heads, keys), tokens * heads * v * c, 0, out
    if fast_paths(par)["projections"]:  # fused q/k/v: v is a view of the projection output, alive whole
        return tokens * (2 * q + 3 * kv) * c, tokens * q * c, (q + 2 * kv) * h * c, tokens * q * c
    # kv heads replicated: this rank's head is a view of the whole v projection output
    v = config.num_kv_heads * hd if kv_replicated(config, tp) else kv
    return tokens * (q + kv + v) * c, tokens * q * c, 0, tokens * q * c


def layer_activations(
    config: ModelConfig,
    par: Parallelism,
    micro: int,
    seq: int,
    recompute: str | None = None,
    attention: str = "sdpa",
    layer: int = 0,
) -> int:
    """Bytes transformer layer `layer` saves for backward for one microbatch (module docstring)."""
    mode = par.recompute if recompute is None else recompute
    tp, c, cp = par.spec.tp, COMPUTE_BYTES[par.precision], par.spec.cp
    local = seq // cp  # the rank's tokens of each row: context parallel's part
    tokens, sp = micro * local, sequence_shards(par)
    h = config.hidden_size
    residual = math.ceil(tokens / sp) * h * c  # a hidden state on the residual stream
    if mode == "full":
        return residual
    heads, sparse = config.num_heads // tp, sparse_layer(config, layer)
    f = mlp_width(config, layer) // tp
    shared = (config.shared_expert_size or 0) // tp if sparse else 0  # a dense MLP beside the experts
    kv = kv_width(config, tp)
    qkv, o_proj_in, weights, out = _attention(
        config, par, tokens, heads, kv, micro * seq if cp > 1 else tokens
    )
    if fast_paths(par)["projections"]:  # fused gate/up: their concatenated weights
        gate_up = f if config.activation in GATED_ACTIVATIONS and not sparse else shared
        weights += 2 * gate_up * h * c
    norms = _norm_activations(config, par, tokens, heads, kv)
    kernel = out + micro * heads * local * 4  # the kernel's output and log-sum-exp
    window = attention_window(config, layer)
    if config.attn_sinks:  # its saves (copies of q, k, v) instead of the kernel's and q, k, v, which
        # selective recompute keeps as the rerun's inputs
        kernel = _sink_attention(config, par, micro, local, heads) - qkv
    if cp > 1:  # selective recompute reruns the cp kernel whole, its gather included
        kernel += _cp_attention(config, par, micro, seq, kv, layer, attention)
    elif window is not None and seq > window and attention != "flash" and not config.attn_sinks:
        kernel += seq * seq * c  # SDPA's additive mask
    mlp = MLP_SAVES[config.activation] * tokens * f * c
    if sparse:  # the routed experts, and a shared one's SwiGLU and sigmoid gate
        mlp = _moe_activations(config, tokens, c, tp) + 4 * tokens * shared * c + 2 * tokens * c
    total = norms + qkv + o_proj_in + mlp + weights
    return total if mode == "selective" else total + kernel


def _layer_kinds(config: ModelConfig, layers: Sequence[int]) -> dict[int, int]:
    """A layer of each kind among `layers` (their window and whether sparse: what
    `layer_activations` reads of a layer)
    and how many of `layers` are of its kind; the planner's long-sequence search sizes a layer once."""
    if config.layer_types is None and not config.dense_layers:  # every layer alike
        return {layers[0]: len(layers)} if len(layers) else {}
    kinds: dict[tuple[int | None, bool], list[int]] = {}
    for i in layers:
        kinds.setdefault((attention_window(config, i), sparse_layer(config, i)), []).append(i)
    return {same[0]: len(same) for same in kinds.values()}


def stage_activations(
    config: ModelConfig, par: Parallelism, stage: int, micro: int, seq: int, attention: str = "sdpa"
) -> int:
    """Bytes a pipeline stage (or the whole model) saves for one microbatch."""
    return _stage_activations(config, par, check_parallelism(config, par), stage, micro, seq, attention)


def _stage_activations(
    config: ModelConfig,
    par: Parallelism,
    layers: list[list[int]],
    stage: int,
    micro: int,
    seq: int,
    attention: str,
) -> int:
    first, last, pipelined = stage == 0, stage == len(layers) - 1, len(layers) > 1
    c, tp, cp = COMPUTE_BYTES[par.precision], par.spec.tp, par.spec.cp
    tokens, h = micro * seq // cp, config.hidden_size
    residual = math.ceil(tokens / sequence_shards(par)) * h * c
    total = sum(
        n * layer_activations(config, par, micro, seq, attention=attention, layer=i)
        for i, n in _layer_kinds(config, layers[stage]).items()
    )
    tables = len({local_rope(config, i) for i in _layer_kinds(config, layers[stage])}) or 1  # Gemma 3
    # The RoPE tables (cos and sin): [S, 1, rotated dims]; under cp per row, [b, S / cp, 1, ...]
    total += tables * 2 * (tokens if cp > 1 else seq) * rope_dim(config) * c
    if first:
        total += tokens * 8  # token ids, for the embedding's backward
    else:
        total -= residual  # the first block's input is a receive buffer (`rank_buffers`)
    if last:
        stat = _norm_stat(config)
        total += residual + math.ceil(tokens / sequence_shards(par)) * stat  # the final norm's input
        if not fast_paths(par)["norms"]:  # and what it saves besides on a sequence shard (plain ops)
            total += _plain_norm_extra(config, residual, c)
        vocab = config.padded_vocab_size
        if fused_loss(par):
            total += tokens * h * c + vocab * h * c  # the gradients the fused loss computed in forward
        else:
            local_vocab = vocab // tp
            total += tokens * h * c + tokens * local_vocab * 4  # the head's input, fp32 log-softmax
            if pipelined:
                total += tokens * local_vocab * c  # logits: the stage's output, kept for its backward
    elif pipelined:
        total += residual  # the stage's output, kept for its backward
    return total


def in_flight(par: Parallelism, pp_rank: int) -> int:
    """Microbatch-chunks whose activations pipeline rank `pp_rank` holds at its peak (module docstring)."""
    P, m, v = par.spec.pp, par.microbatches, par.stages_per_rank
    schedule = par.spec.schedule
    if P * v == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, P - pp_rank)
    if schedule == "zbv":
        return min(2 * m, 2 * P)
    per_round = m // max(1, m // P)
    hop = 2 if schedule == "interleaved1f1b" else 1
    return min(m * v, (v - 1) * per_round + hop * (P - 1 - pp_rank) + 1)


def rank_activations(
    config: ModelConfig, par: Parallelism, pp_rank: int, micro: int, seq: int, attention: str = "sdpa"
) -> int:
    """Bytes of activations pipeline rank `pp_rank` holds at its peak: its in-flight chunks (of its
    local stages, on average) and, with full recompute, one layer recomputed in the backward."""
    stages, layers = par.rank_stages(pp_rank), check_parallelism(config, par)
    chunks = [_stage_activations(config, par, layers, s, micro, seq, attention) for s in stages]
    per_chunk = sum(chunks) / len(chunks)
    total = round(in_flight(par, pp_rank) * per_chunk)
    if par.recompute == "full":  # the largest layer (a sliding one may add its mask)
        total += max(
            layer_activations(config, par, micro, seq, "none", attention, i)
            for i in _layer_kinds(config, range(config.num_layers))
        )
    return total
