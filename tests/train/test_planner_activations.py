"""The planner's activations by closed form (`megacore.planner`): the microbatches each pipeline
schedule holds in flight; latent attention's, attention sinks' and the clamped SwiGLU's saved
tensors against what the layers hand autograd; context parallel's activations, the longest
sequence a layout fits and where cp is proposed; fp8's gathered projections. Against a measured
step: test_planner.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from megacore import planner
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.config_parts import StandardAttentionSpec
from megacore.parallel.layout import Parallelism
from megacore.planner import GiB
from planner_cases import SHAPES, dry_run
from runlib import write_run


def test_in_flight_microbatches_follow_the_schedules() -> None:
    """GPipe holds every microbatch, 1F1B pp on its first stage and one on its last, interleaved
    1F1B torch's own warmup count plus one (its schedules' `_get_warmup_ops`), none without a pipeline."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    def par(schedule: str, pp: int, m: int, v: int = 1) -> Parallelism:
        return Parallelism(ParallelSpec(pp=pp, schedule=schedule, virtual_stages=v), "bf16", m)

    assert [planner.in_flight(par("1f1b", 4, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert [planner.in_flight(par("1f1b", 4, 2), r) for r in range(4)] == [2, 2, 2, 1]
    assert [planner.in_flight(par("gpipe", 4, 8), r) for r in range(4)] == [8] * 4
    assert planner.in_flight(par("1f1b", 1, 8), 0) == 1
    for schedule, factor in (("interleaved1f1b", 2), ("interleavedzb", 1)):
        for pp, m, v in ((2, 4, 2), (4, 8, 2), (4, 16, 3), (4, 4, 2)):
            per_round = m // max(1, m // pp)
            for r in range(pp):
                warmup = _get_warmup_ops(r, v, per_round, pp, m, multiply_factor=factor)
                assert planner.in_flight(par(schedule, pp, m, v), r) == min(warmup + 1, m * v)


# DeepSeek V3's latent attention at a small size, its MLP dense: q through a rank-64 pair, a latent
# of 32 and a rope part of 16 shared by the heads, q and k heads of 48, v heads of 32.
MLA = {
    "family": "deepseek_v3", "vocab_size": 512, "hidden_size": 128, "num_layers": 1, "num_heads": 8,
    "num_kv_heads": 8, "ffn_hidden_size": 192, "max_seq_len": 256, "head_dim": 48,
    "attention": {"type": "latent", "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
}  # fmt: skip


def saved_bytes(forward: Callable[[], object], skip: tuple) -> int:
    """The bytes of the storages a forward hands autograd (saved tensor hooks), each once, those
    of `skip` (weights, inputs, RoPE tables) left out."""
    import torch

    skipped = {t.untyped_storage().data_ptr() for t in skip}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skipped:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


def latent_norm_bytes(tokens: int, width: int, stored: int, c: int, plain: bool) -> int:
    """A latent RMSNorm over `width` dims of a projection output `stored` wide: its input (a view,
    which keeps the whole output), fp32 rstd and its output (the expansion's input). Plain
    nn.RMSNorm (tp > 1) saves its fp32 normalised input too, and in bf16 an fp32 copy of its input
    instead of the view."""
    saved = tokens * stored * c if not plain or c == 4 else tokens * width * 4
    return saved + tokens * 4 + tokens * width * c + (tokens * width * 4 if plain else 0)


def latent_attention_bytes(shape: dict, heads: int, micro: int, seq: int, c: int, plain: bool) -> int:
    """What LatentAttention's forward saves for `heads` heads, by hand: kv_a_proj's output's norm,
    q_a_proj's (with q_lora_rank), q and k of heads x head_dim, v padded to head_dim, the kernel's
    output and fp32 log-sum-exp, o_proj's input of heads x v_head_dim (sliced out of the output, a
    copy). A v as wide as q's heads is a view of kv_b_proj's whole nope + v output, and o_proj's
    input a view of the kernel's output ([b, s, heads, d] as q, a cat, is): the output once."""
    la = shape["attention"]
    T, hd, v, rope = micro * seq, shape["head_dim"], la["v_head_dim"], la["qk_rope_head_dim"]
    latent, q_lora = la["kv_lora_rank"], la["q_lora_rank"]
    total = latent_norm_bytes(T, latent, latent + rope, c, plain)
    total += latent_norm_bytes(T, q_lora, q_lora, c, plain) if q_lora else 0
    v_saved = hd if v < hd else hd - rope + v
    qkv = T * heads * (2 * hd + v_saved) * c
    out = T * heads * hd * c if v < hd else 0
    return total + qkv + out + micro * heads * seq * 4 + T * heads * v * c


@pytest.mark.parametrize("plain", [False, True], ids=["fused-norms", "plain-norms"])
@pytest.mark.parametrize("v_head_dim", [32, 48])
@pytest.mark.parametrize("q_lora_rank", [None, 64])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_latent_attention_saves_what_the_closed_form_counts(
    precision: str, q_lora_rank: int | None, v_head_dim: int, plain: bool
) -> None:
    """The closed form against the tensors LatentAttention's forward hands autograd (saved tensor
    hooks; the weights, the input and the RoPE tables left out, each storage once): with and
    without q's low-rank pair, v narrower than q's heads (padded) and as wide, fused and plain
    (tp > 1) latent norms."""
    import torch

    from megacore.models.decoder import LatentAttention
    from megacore.models.layers import FastPaths
    from megacore.models.rope import rope_tables

    shape = {**MLA, "attention": {**MLA["attention"], "q_lora_rank": q_lora_rank, "v_head_dim": v_head_dim}}
    config, dtype = (
        msgspec.convert(shape, ModelConfig),
        {"fp32": torch.float32, "bf16": torch.bfloat16}[precision],
    )
    micro, seq = 2, 64
    attn = LatentAttention(config, impl="sdpa", fast=FastPaths(head_norms=not plain)).to(dtype)
    x = torch.randn(micro, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(config, seq, "cpu", dtype)
    saved = saved_bytes(lambda: attn(x, cos, sin), (*attn.parameters(), x, cos, sin))
    c = 4 if precision == "fp32" else 2
    assert saved == latent_attention_bytes(shape, config.num_heads, micro, seq, c, plain)


@pytest.mark.parametrize("q_lora_rank", [None, 64])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_latent_attention_layers_are_sized_by_their_own_tensors(
    tp: int, precision: str, q_lora_rank: int | None
) -> None:
    """A latent-attention layer (its MLP dense) at tp 1 and 2, recompute none and selective: the
    planner's bytes are those worked out here, the attention's from its own tensors (the latent
    projections' outputs whole on every tp rank, the heads split, v padded to q's heads) and not a
    standard attention's of as many heads."""
    shape = {**MLA, "attention": {**MLA["attention"], "q_lora_rank": q_lora_rank}}
    config = msgspec.convert(shape, ModelConfig)
    micro, seq, c = 2, 128, 4 if precision == "fp32" else 2
    T, h, f, heads = micro * seq, MLA["hidden_size"], MLA["ffn_hidden_size"] // tp, MLA["num_heads"] // tp
    norms = 2 * (T * h * c + T * 4) + 2 * T * h * c  # inputs, fp32 rstd, outputs
    mlp = 4 * T * f * c + (2 * f * h * c if tp == 1 else 0)  # gate, up, silu, product; fused gate/up's
    attention = latent_attention_bytes(shape, heads, micro, seq, c, plain=tp > 1)
    kernel = T * heads * MLA["head_dim"] * c + micro * heads * seq * 4  # its output and log-sum-exp
    for recompute, want in (
        ("none", norms + attention + mlp),
        ("selective", norms + attention + mlp - kernel),
    ):
        par = Parallelism(ParallelSpec(tp=tp), precision, 1, False, recompute)
        assert planner.layer_activations(config, par, micro, seq) == want, recompute


# gpt-oss's attention and MLP at a small size, its MLP dense: 8 q heads of 16 over 2 kv heads, q/k/v
# and o biases, sinks, a window of 16 on its first layer, the clamped SwiGLU with biases.
SINKS = {
    "family": "gpt_oss", "vocab_size": 512, "hidden_size": 128, "num_layers": 2, "num_heads": 8,
    "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 96, "max_seq_len": 256,
    "attention": StandardAttentionSpec(bias=True, out_bias=True, sinks=True), "mlp_bias": True, "activation": "clamped_swiglu",
    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
}  # fmt: skip


def sink_layer_bytes(micro: int, seq: int, c: int, recompute: str) -> int:
    """What a layer of SINKS saves at tp 1, by hand: the norms' inputs, rstd and outputs; the fused
    q/k/v and gate/up matmuls' concatenated weights; o_proj's input; the clamped SwiGLU's gate and
    up (the fused output), clamped gate, sigmoid, their product, up + 1 and product (7 x ffn). The
    attention with sinks as on a GPU: the fp32 softmax over the scores and the sink column, the
    probabilities in the compute dtype (fp32: the softmax's), fp32 copies of q and k, a copy of v
    (repeated to q's heads), the boolean S x S mask, and not the q/k/v projection's output;
    selective recompute keeps that output (q, k and v, the rerun's inputs) instead."""
    T, h, f, heads, hd = micro * seq, SINKS["hidden_size"], SINKS["ffn_hidden_size"], 8, 16
    q, kv = heads * hd, 2 * hd
    norms = 2 * (T * h * c + T * 4) + 2 * T * h * c
    weights = (q + 2 * kv) * h * c + 2 * f * h * c
    mlp = 7 * T * f * c
    if recompute == "selective":
        return norms + weights + T * (2 * q + 3 * kv) * c + T * q * c + mlp
    scores = micro * heads * seq * (seq + 1) * 4 + (micro * heads * seq * seq * c if c < 4 else 0)
    sinks = scores + T * q * (4 + 4 + c) + seq * seq
    return norms + weights + sinks + T * q * c + mlp


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sink_attention_and_clamped_swiglu_layers_are_sized_by_what_they_save(
    precision: str, layer: int, monkeypatch
) -> None:
    """A gpt-oss layer at tp 1: the closed form against the tensors its block hands autograd (saved
    tensor hooks, the weights and the RoPE tables left out, each storage once) with the sinks'
    GPU path (the math one, through autograd) run on the CPU; the planner's bytes, recompute none
    and selective, are the closed form's."""
    import torch

    from megacore.models import attention, sinks
    from megacore.models.decoder import Block
    from megacore.models.rope import rope_tables

    def gpu_path(q, k, v, sink, mask, scale=None):
        return sinks._math_sink_attention(
            q, k, v, sink, mask, q.shape[-1] ** -0.5 if scale is None else scale
        )

    monkeypatch.setattr(attention, "sink_attention", gpu_path)
    config, dtype = ModelConfig(**SINKS), {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    micro, seq, c = 2, 64, 4 if precision == "fp32" else 2
    block = Block(config, layer, "sdpa").to(dtype)
    x = torch.randn(micro, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(config, seq, "cpu", dtype)
    saved = saved_bytes(lambda: block(x, cos, sin), (*block.parameters(), cos, sin))
    assert saved == sink_layer_bytes(micro, seq, c, "none")
    for recompute in ("none", "selective"):
        par = Parallelism(ParallelSpec(), precision, 1, False, recompute)
        got = planner.layer_activations(config, par, micro, seq, layer=layer)
        assert got == sink_layer_bytes(micro, seq, c, recompute), recompute


# --- context parallel: activations, the longest sequence, the layouts ----------------------------

# A small Llama whose every tensor has an even number of rows: FSDP2 over 2 ranks halves each.
LONG = {
    "family": "llama", "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "ffn_hidden_size": 128, "max_seq_len": 64,
}  # fmt: skip
V, H, L, HEADS, HD, FFN = 512, 64, 2, 4, 16, 128
Q, KV = HEADS * HD, 2 * HD  # the widths of q and of k (and v), tp 1


def layer_bytes(tokens: int, micro: int, seq: int, cp: int, c: int, window: int | None = None) -> int:
    """What a layer of LONG saves at tp 1, recompute none, for `tokens` = micro x seq / cp, by
    hand: the norms' inputs, fp32 rstd and outputs, the fused q/k/v's output (alive whole) with
    rotated q and k, the concatenated q/k/v and gate/up weights, o_proj's input, the kernel's
    output and fp32 log-sum-exp, the MLP's gate, up, silu and product; under cp the whole
    sequence's k and v gathered and, with a window, the two chunks' masks of n = seq / 2cp rows,
    ending at (r + 1)·n and (2cp - r)·n on rank r."""
    norms = 2 * (tokens * H * c + tokens * 4) + 2 * tokens * H * c
    qkv = tokens * (2 * Q + 3 * KV) * c
    weights = (Q + 2 * KV) * H * c + 2 * FFN * H * c
    kernel = 2 * tokens * Q * c + micro * HEADS * (seq // cp) * 4  # o_proj's input too
    mlp = 4 * tokens * FFN * c
    total = norms + qkv + weights + kernel + mlp
    if cp > 1:
        total += 2 * micro * seq * KV * c
        n = seq // (2 * cp)
        total += (n * 2 * n + n * 3 * n) * c if window is not None else 0  # rank 1 of cp 2
    elif window is not None and seq > window:
        total += seq * seq * c
    return total


@pytest.mark.parametrize("window", [None, 128])
def test_cp_activations_are_a_sequence_of_s_over_cp_plus_the_gathered_kv(window: int | None) -> None:
    """Per layer, cp 2 saves what a sequence of S / 2 does plus the whole sequence's k and v (and
    with a window its chunks' masks instead of the S x S one): within that, half of cp 1's."""
    config = ModelConfig(**{**LONG, "sliding_window": window})
    micro, seq, c = 2, 1024, 2
    by_cp = {}
    for cp in (1, 2):
        par = Parallelism(ParallelSpec(cp=cp), "bf16", 1, False, "none")
        by_cp[cp] = planner.layer_activations(config, par, micro, seq)
        assert by_cp[cp] == layer_bytes(micro * seq // cp, micro, seq, cp, c, window), cp
    gathered = 2 * micro * seq * KV * c
    fixed = (Q + 2 * KV) * H * c + 2 * FFN * H * c  # the fused weights: no tokens in them
    cp1_mask = seq * seq * c if window else 0
    cp2_mask = 5 * (seq // 4) ** 2 * c if window else 0
    assert by_cp[2] - gathered - cp2_mask - fixed == (by_cp[1] - cp1_mask - fixed) // 2
    ratio = by_cp[2] / by_cp[1]
    if window is None:  # a half, plus the gathered k and v and the fused weights (which do not halve)
        assert 0.5 < ratio < 0.6, ratio
    else:  # the masks shrink faster: 5 / 16 of cp 1's
        assert ratio < 0.5, ratio


def rank_bytes(seq: int, recompute: str) -> int:
    """The fullest rank of LONG at fp32, tp 1 x pp 1 x cp 2 x dp 1, micro batch 1 in one
    microbatch, sdpa, worked out by hand (module docstring of `planner.activations`)."""
    c, cp, replicas, T = 4, 2, 2, seq // 2
    block = 2 * H + Q * H + 2 * KV * H + H * Q + 3 * FFN * H  # norms, q k v o, gate up down
    root = V * H + H + V * H  # embedding, final norm, head (untied)
    params, tensors = root + L * block, 3 + 9 * L
    # FSDP2 over dp x cp = 2 ranks: every tensor's rows even, each rank holds half of it.
    state = (4 + 4 + 8) * params // replicas + 4 * tensors  # weights, grads, AdamW, step counters
    # Unsharded: the root and two blocks (prefetch); a reduction's gradients in fp32, twice.
    fsdp = (root + 2 * block) * c + max(root, block) * (c + 4)
    # A layer's gathered k/v gradients; the fused loss's fp32 logits chunk (all T tokens).
    buffers = 2 * seq * KV * c + T * V * 4
    layer = layer_bytes(T, 1, seq, cp, c)
    layers = L * layer if recompute == "none" else L * T * H * c + layer  # full: inputs + a recompute
    # RoPE cos/sin per row, token ids, the final norm's input and rstd, the fused loss's gradients.
    stage = 2 * T * HD * c + T * 8 + T * H * c + T * 4 + T * H * c + V * H * c
    return state + fsdp + buffers + layers + stage


def test_the_longest_sequence_a_layout_fits_agrees_with_a_closed_form(
    tmp_path: Path, tokens: Path, capsys
) -> None:
    """A cp 2 run of 2 GPUs of 4 GiB + 48 MiB: the dry run's longest seq_length for its layout, with
    recompute none and full, is the longest multiple of 4 (2 x cp) the hand-worked bytes fit in 48
    MiB; the --gpus listing names the same for cp 2, and says it."""
    budget = 48 << 20
    expected = {}
    for recompute in ("none", "full"):
        base, per_4 = rank_bytes(0, recompute), rank_bytes(4, recompute) - rank_bytes(0, recompute)
        assert rank_bytes(8, recompute) - rank_bytes(4, recompute) == per_4  # linear: no window
        expected[recompute] = 4 * ((budget - base) // per_4)
        n = expected[recompute]
        assert rank_bytes(n, recompute) <= budget < rank_bytes(n + 4, recompute)
    assert expected["full"] > expected["none"] > 1000, expected
    run_json = write_run(
        tmp_path,
        tokens,
        model={"config": LONG},
        batch={"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 32},
        parallel={"cp": 2},
        eval={"every": 0},
    )
    argv = ["--manifest", run_json, "--dry-run", "--gpus", 2, "--gpu-memory", f"{4096 + 48}MiB"]
    code, out, err = dry_run(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    own = plan["memory"]["longest"]
    assert (own["none"], own["full"]) == (expected["none"], expected["full"]), (own, expected)
    (cp2,) = [c for c in plan["layouts"]["longest"] if c["cp"] == 2]
    assert (cp2["tp"], cp2["pp"], cp2["dp"]) == (1, 1, 1)
    assert cp2["seq_length"] == own and cp2["label"] == "tp 1 x pp 1 x cp 2 x dp 1", cp2
    code, text, err = dry_run(capsys, *argv)
    assert code == 0, err
    assert f"longest sequence that fits this layout: {expected['none']:,} tokens with recompute none" in text
    assert f"{expected['full']:,} tokens at tp 1 x pp 1 x cp 2 x dp 1 with recompute full" in text, text


def test_cp_is_proposed_where_it_helps() -> None:
    """Of 2 GPUs, at a short sequence dp 2 holds the batch as well and pays no collectives: no cp
    layout is listed. At a sequence whose activations dp 2 cannot hold even with full recompute,
    cp 2 (FSDP2 over the same 2 ranks, half the tokens each) fits, and is listed."""
    config = ModelConfig(**LONG)
    base = Parallelism(ParallelSpec(), "bf16", 1, False, "none")
    short = planner.search(config, base, 2, 80 * GiB, 1, 64, 2)
    assert short[0].fits and all(c.dims.cp == 1 for c in short), [c.label for c in short]

    seq = 1 << 16

    def need(cp: int) -> int:
        dp = 2 // cp
        par = Parallelism(ParallelSpec(cp=cp), "bf16", 2 // dp, False, "full")  # global batch 2
        return planner.peak(planner.estimate(config, par, dp, 1, seq, all_dp_ranks=False))

    gpu_memory = planner.ALLOWANCE + (need(1) + need(2)) // 2
    found = {
        (c.dims.tp, c.dims.pp, c.dims.cp, c.dims.dp): c
        for c in planner.search(config, base, 2, gpu_memory, 1, seq, 2)
    }
    assert not found[1, 1, 1, 2].fits and found[1, 1, 2, 1].fits, found
    assert found[1, 1, 2, 1].label.startswith("tp 1 x pp 1 x cp 2 x dp 1, recompute ")


def test_cp_costs_less_the_longer_the_sequence() -> None:
    """The throughput model: cp's collectives against a layer's compute weigh less at 128k than at
    4k, more when the cp group spans nodes, and cp 1 pays nothing for them."""
    config = msgspec.convert({**SHAPES["llama2-7b"], "max_seq_len": 1 << 17}, ModelConfig)

    def throughput(cp: int, seq: int, gpus_per_node: int = 8) -> float:
        par = Parallelism(ParallelSpec(cp=cp), "bf16", 1, False, "none")
        return planner.relative_throughput(config, par, 1, seq, gpus_per_node)

    assert throughput(1, 4096) == throughput(1, 1 << 17) == 1.0
    dp_cost = planner.DP_EFFICIENCY  # FSDP2 over cp's ranks
    assert throughput(8, 4096) < throughput(8, 1 << 17) < dp_cost
    assert throughput(8, 1 << 17) > 0.95 * dp_cost  # Llama 2 7B: 32 kv heads, 3% at 128k
    assert throughput(8, 4096, gpus_per_node=4) < throughput(8, 4096)


@pytest.mark.parametrize("pp", [1, 2])
def test_fp8_tensorwise_gathers_the_projections_in_a_byte(pp: int) -> None:
    """fp8 under FSDP2: tensorwise scaling all-gathers the blocks' projections in float8, rowwise in
    bf16; their buffers differ by a byte per gathered element, worked out here from the shapes: two
    blocks' projections with prefetch, a pipeline stage's every block without resharding."""
    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=128)  # fmt: skip
    head = cfg.hidden_size // cfg.num_heads
    projections = (
        2 * cfg.hidden_size * cfg.num_heads * head  # q, o
        + 2 * cfg.hidden_size * cfg.num_kv_heads * head  # k, v
        + 3 * cfg.hidden_size * cfg.ffn_hidden_size  # gate, up, down
    )
    blocks = 2 if pp == 1 else cfg.num_layers // pp

    def buffers(scaling: str) -> int:
        par = Parallelism(ParallelSpec(pp=pp), precision="fp8", fp8_scaling=scaling, microbatches=2 * pp)
        return planner.estimate(cfg, par, 2, 2, 64, all_dp_ranks=False)[0].buffers

    assert buffers("rowwise") - buffers("tensorwise") == blocks * projections
