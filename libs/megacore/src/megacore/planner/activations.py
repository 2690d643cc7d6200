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
  (`attention_window`). Latent attention (DeepSeek V3, `attention` type latent) instead of q/k/v: kv_a_proj's
  output (latent + rope wide, whole on every tp rank: its norm's input is a view of it), q_a_proj's
  (q_lora_rank), their norms' fp32 statistics and outputs (under tp plain nn.RMSNorm, with an fp32
  normalised input besides, and in a 2-byte dtype an fp32 copy of the input for it), q and k of
  heads x head_dim, v padded to head_dim, the kernel's head_dim-wide output, o_proj's input of
  heads x v_head_dim. Attention sinks (gpt-oss) on a GPU: the fp32 scores' softmax, the
  probabilities, copies of q, k and v and a boolean mask, S x S per head, not SDPA's tensors
  (`parts.attention.sink_saves`; context parallel's chunks are sized as without sinks). The MLP's tensors
  ffn wide by the activation (`parts.mlp.MLP_SAVES`: gpt-oss's clamped SwiGLU 7). selective: without the attention kernel's output and log-sum-exp (its
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
Each layer's terms are its parts' (`megacore.parts`: the block's norms, the attention's, the
MLP's); this module adds them up with the kernel's, context parallel's and the stage's.
How close it comes to a measured step: `megacore.planner.memory`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megacore.config import ModelConfig, attention_window, linear_layer, local_rope, rope_dim, sparse_layer
from megacore.parallel.build_rules import fast_paths, fused_loss
from megacore.parallel.dims import Parallelism
from megacore.parallel.layout import check_parallelism
from megacore.parts import attention as standard_attention
from megacore.parts import attention_part, block, linear, mlp_part, norm
from megacore.parts.attention import kv_width
from megacore.parts.compute import Compute

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 but the float8 matmuls


def sequence_shards(par: Parallelism) -> int:
    """The parts sequence parallel cuts the residual stream into: tp with sequence parallel."""
    return par.spec.tp if par.spec.sequence_parallel and par.spec.tp > 1 else 1


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
    gathered = attention_part(config, layer).cp_gathered(config, micro, seq, kv, c)
    window, n = attention_window(config, layer), seq // (2 * cp)
    if window is None or attention == "flash":
        return gathered
    ends = [((r + 1) * n, (2 * cp - r) * n) for r in range(cp)]
    return gathered + max(sum(n * end * c for end in pair if end > window) for pair in ends)


def compute(par: Parallelism) -> Compute:
    """What the parts' planner terms read of a rank's step under `par`."""
    return Compute(COMPUTE_BYTES[par.precision], par.spec.tp, sequence_shards(par), fast_paths(par))


def layer_activations(
    config: ModelConfig,
    par: Parallelism,
    micro: int,
    seq: int,
    recompute: str | None = None,
    attention: str = "sdpa",
    layer: int = 0,
) -> int:
    """Bytes transformer layer `layer` saves for backward for one microbatch (module docstring):
    its parts' terms (`megacore.parts`), the attention kernel's, and context parallel's."""
    mode = par.recompute if recompute is None else recompute
    comp, cp = compute(par), par.spec.cp
    local = seq // cp  # the rank's tokens of each row: context parallel's part
    tokens = micro * local
    if mode == "full":
        return math.ceil(tokens / comp.sp) * config.hidden_size * comp.c  # the block's input
    mlp, mlp_weights = mlp_part(config, layer).saves(config, comp, tokens, layer)
    if linear_layer(config, layer):  # its kernel keeps its inputs alone: nothing for recompute to drop
        return (
            block.norm_saves(config, comp, tokens)
            + linear.saves(config, comp, micro, local)
            + mlp
            + mlp_weights
        )
    heads, kv, attn = config.num_heads // comp.tp, kv_width(config, comp.tp), attention_part(config, layer)
    qkv, o_proj_in, weights, out = attn.saves(
        config, comp, tokens, heads, kv, micro * seq if cp > 1 else tokens
    )
    norms = block.norm_saves(config, comp, tokens) + attn.head_norm_saves(config, comp, tokens, heads, kv)
    kernel = out + micro * heads * local * 4  # the kernel's output and log-sum-exp
    window = attention_window(config, layer)
    sinks = config.latent is None and config.attention.sinks
    if sinks:  # its saves (copies of q, k, v) instead of the kernel's and q, k, v, which
        # selective recompute keeps as the rerun's inputs
        kernel = standard_attention.sink_saves(config, comp, micro, local, heads) - qkv
    if cp > 1:  # selective recompute reruns the cp kernel whole, its gather included
        kernel += _cp_attention(config, par, micro, seq, kv, layer, attention)
    elif window is not None and seq > window and attention != "flash" and not sinks:
        kernel += seq * seq * comp.c  # SDPA's additive mask
    total = norms + qkv + o_proj_in + mlp + weights + mlp_weights
    return total if mode == "selective" else total + kernel


def _layer_kinds(config: ModelConfig, layers: Sequence[int]) -> dict[int, int]:
    """A layer of each kind among `layers` (their window, whether sparse, whether linear: what
    `layer_activations` reads of a layer)
    and how many of `layers` are of its kind; the planner's long-sequence search sizes a layer once."""
    if config.layer_types is None and not (config.moe and config.moe.dense_layers):  # every layer alike
        return {layers[0]: len(layers)} if len(layers) else {}
    kinds: dict[tuple[int | None, bool], list[int]] = {}
    for i in layers:
        kind = (attention_window(config, i), sparse_layer(config, i), linear_layer(config, i))
        kinds.setdefault(kind, []).append(i)
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
        stat = norm.stat_bytes(config)
        total += residual + math.ceil(tokens / sequence_shards(par)) * stat  # the final norm's input
        if not fast_paths(par)["norms"]:  # and what it saves besides on a sequence shard (plain ops)
            total += norm.plain_extra(config, residual, c)
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
