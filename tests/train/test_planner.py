"""The memory and layout planner (`megacore.planner`, `mega-train --dry-run --gpus N
--gpu-memory 80GB`): its state bytes are the tensors a live run holds on every rank, its
activation estimate is within 25% of a measured step (cp 2: 10% of the tensors autograd saves),
it judges Megatron-LLM's 80 GB layouts feasible and names its own picks, docs/mega-train.md's table of them
holds the planner's figures and agrees with closed forms from the models' published shapes, the
longest sequence a layout fits agrees with a closed form, context parallel is proposed where it
helps, and its command line follows the tools' conventions."""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from helpers import assert_one_line_error, dry_run_without_torch, run_in_process, torchrun_script
from megacore import planner
from megacore.artifacts.manifest import ParallelSpec
from megacore.config import ModelConfig, model_tensors
from megacore.errors import UserError
from megacore.parallel.layout import Parallelism
from runlib import write_run

WORKER = Path(__file__).with_name("planner_worker.py")
GiB = planner.GiB


def launch(tmp_path: Path, nproc: int, scenarios: list[dict]) -> str:
    spec = tmp_path / f"scenarios-{nproc}.json"
    spec.write_text(json.dumps(scenarios))
    proc = torchrun_script(nproc, WORKER, spec, timeout=600)
    passed = [line for line in proc.stdout.splitlines() if " PASS on " in line]
    assert len(passed) == len(scenarios), proc.stdout
    return proc.stdout


# --- state: exact, against a live run -------------------------------------------------------------


# A hidden-256 Llama at sequence 256 (`ACT_CONFIG`'s shapes) with a window of 64: cp 2's measured step.
CP_MEASURED = {
    "cp": 2, "precision": "bf16", "microbatches": 1, "seq": 256, "measure": True,
    "config": {"vocab_size": 1000, "padded_vocab_size": 1024, "hidden_size": 256, "num_heads": 8,
               "num_kv_heads": 4, "ffn_hidden_size": 688, "max_seq_len": 512, "sliding_window": 64},
}  # fmt: skip
# Latent attention (DeepSeek V3's, q LoRA, v narrower than q and k) at cp 2: the normed latent and
# the rotated k gathered, the whole rows' k and v expanded from them on each rank.
MLA_CP_MEASURED = {
    **CP_MEASURED,
    "config": {"family": "deepseek_v3", "vocab_size": 1000, "padded_vocab_size": 1024, "hidden_size": 256,
               "num_heads": 8, "num_kv_heads": 8, "head_dim": 48, "q_lora_rank": 96, "kv_lora_rank": 64,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "ffn_hidden_size": 688, "max_seq_len": 512},
}  # fmt: skip


# QLoRA's projections hold whole NF4 scaler blocks, two or more (FSDP2's dp 2 shards too).
NF4_CONFIG = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 512, "num_layers": 2}


@pytest.mark.dist
def test_state_bytes_equal_what_two_processes_hold(tmp_path: Path) -> None:
    """tp2, pp2, dp2 (FSDP2, an uneven ffn), fp32/bf16/fp16; the bf16 compute copies without dp;
    the zero-bubble schedule's FSDP2 fallback; replicate; the vocab-parallel embedding's whole
    gradient under tp without FSDP2; tied embeddings under tp and under pp (the last stage's copy);
    cp 2 (FSDP2 over cp alone, no compute copies), whose step the worker also measures, and latent
    attention's at cp 2: its activations against the tensors autograd saves, with buffers against
    the step's peak. LoRA
    at dp 2, pp 2 in bf16 and tp 2; QLoRA at dp 2 and pp 2 in bf16 (NF4 tensors counted by their
    inner tensors' bytes)."""
    launch(
        tmp_path,
        2,
        [
            {"tp": 2},
            {"tp": 2, "precision": "bf16", "sp": True},
            {"tp": 2, "config": {"tie_embeddings": True}},
            {"pp": 2},
            {"pp": 2, "precision": "bf16"},
            {"pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
            {"pp": 2, "schedule": "zbv", "precision": "bf16"},
            {"pp": 2, "config": {"tie_embeddings": True}},  # the last stage's copy of the embedding
            {"pp": 2, "schedule": "zbv", "config": {"tie_embeddings": True}},
            {},
            {"precision": "bf16", "config": {"ffn_hidden_size": 65}},
            {"precision": "fp16"},
            {"dp_mode": "replicate", "precision": "bf16"},
            CP_MEASURED,
            MLA_CP_MEASURED,
            # LoRA: the frozen base's weights alone (in bf16 alone under compute copies), the
            # adapters' gradients, moments and copies; QLoRA: its projections' NF4 bytes.
            {"lora": True},
            {"lora": True, "pp": 2, "precision": "bf16"},
            {"lora": True, "tp": 2, "sp": True},
            {"lora": True, "base_dtype": "nf4", "config": NF4_CONFIG},
            {"lora": True, "base_dtype": "nf4", "precision": "bf16", "pp": 2, "config": NF4_CONFIG},
        ],
    )


# Mixtral's switches on the tiny Llama: 2 experts of ffn 64, top-1.
MOE = {"family": "mixtral", "num_experts": 2, "experts_per_token": 1}


@pytest.mark.dist
@pytest.mark.slow  # 30 s of 4 processes on 2 cores; the 2-process layouts run with `make test`
def test_state_bytes_equal_what_four_processes_hold(tmp_path: Path) -> None:
    """tp2 x pp2, tp2 x dp2 (FSDP2 over tensor-parallel shards), pp2 x dp2, tp4 (kv heads
    replicated), dp4 with chunks of 17, 17, 17 and 14 rows (ffn 65) and of 2, 2, 2 and none
    (hidden 6); dp2 x cp2, FSDP2 over both flattened, dp outer: chunks of 2, 2, 1 and none (ffn 5)
    tell rank 1 (dp 0, cp 1) from rank 2; tp2 x cp2 with sequence parallel; a mixture of 2
    experts over dp 4 (FSDP2 cuts the experts' rows, not the 2 experts), at ep 2, at ep 2 x tp 2
    (each expert's ffn split over tp, FSDP2 then cuts its other dim) and at ep 2 x cp 2 (FSDP2 cuts
    the experts' rows over edp x cp)."""
    launch(
        tmp_path,
        4,
        [
            {"tp": 2, "pp": 2},
            {"tp": 2, "pp": 2, "precision": "bf16"},
            {"tp": 2, "precision": "bf16"},
            {"pp": 2, "precision": "bf16"},
            {"tp": 4},
            {"config": {"ffn_hidden_size": 65, "hidden_size": 6, "num_heads": 1, "num_kv_heads": 1}},
            {"cp": 2, "config": {"ffn_hidden_size": 5, "hidden_size": 6, "num_heads": 1, "num_kv_heads": 1}},
            {"tp": 2, "cp": 2, "precision": "bf16", "sp": True},
            {"config": MOE},
            {"config": MOE, "ep": 2, "precision": "bf16"},
            {"config": MOE, "ep": 2, "tp": 2},
            {"config": MOE, "ep": 2, "cp": 2},  # the experts over edp x cp: ranks 0 and 1 (ep 0)
        ],
    )


# --- activations: against a measured step ----------------------------------------------------------

ACT_CONFIG = ModelConfig(
    family="llama", vocab_size=1000, padded_vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8,
    num_kv_heads=4, ffn_hidden_size=688, max_seq_len=512,
)  # fmt: skip
MICRO, SEQ = 2, 256


def measured_peak(pm, tokens, targets, kept: int = 0) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.forward_backward(tokens, targets)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    # The step left nothing behind but `kept` bytes (an MoE layer's statistics of the step).
    assert live == kept and torch.is_tensor(pm.parameters().__next__().grad), (live, kept)
    return peak


# Mixtral's shape at the same size: 4 experts of a quarter of the dense ffn each, top-2.
MOE_ACT_CONFIG = msgspec.structs.replace(
    ACT_CONFIG, family="mixtral", ffn_hidden_size=172, num_experts=4, experts_per_token=2
)

# DeepSeek V3's latent attention at the same size (its MLP dense): q and k heads of 48, v of 32.
MLA_ACT_CONFIG = msgspec.structs.replace(
    ACT_CONFIG, family="deepseek_v3", num_kv_heads=8, head_dim=48, q_lora_rank=96, kv_lora_rank=64,
    qk_rope_head_dim=16, v_head_dim=32,
)  # fmt: skip
ACT_IDS = {id(ACT_CONFIG): "llama", id(MOE_ACT_CONFIG): "mixtral", id(MLA_ACT_CONFIG): "deepseek-mla"}


@pytest.mark.parametrize(
    ("recompute", "precision", "config"),
    [(r, "fp32", ACT_CONFIG) for r in ("none", "selective", "full")]
    # bf16 steps are the slow ones on a CPU without bf16 matmuls: selective with `make test`
    + [
        pytest.param(r, "bf16", ACT_CONFIG, marks=() if r == "selective" else pytest.mark.slow)
        for r in ("none", "selective", "full")
    ]
    + [("none", "fp32", MOE_ACT_CONFIG), ("selective", "bf16", MOE_ACT_CONFIG)]
    + [
        ("none", "fp32", MLA_ACT_CONFIG),
        pytest.param("selective", "bf16", MLA_ACT_CONFIG, marks=pytest.mark.slow),
    ],
    ids=lambda v: ACT_IDS[id(v)] if isinstance(v, ModelConfig) else v,
)
def test_activation_estimate_is_within_25_percent_of_a_measured_step(
    recompute: str, precision: str, config: ModelConfig, monkeypatch
) -> None:
    """Method: the peak increase of the CPU allocator's live bytes during one step (forward and
    backward of one microbatch through the engine's `ParallelModel`, one process, no pipeline), from
    torch.profiler's memory events (profile_memory=True records every allocation and free of the
    CPU allocator, in time order: their running sum is the live bytes). A first step ran before,
    not zeroed, so the gradients exist (the planner counts them as state) and the fused loss's
    scratch buffers are warm: the increase is what a step adds, the saved activations and the
    working buffers of the moment. The estimate is `rank_activations`."""
    import torch

    from megacore.parallel.engine import ParallelModel
    from megacore.parallel.mesh import build_mesh, shutdown

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a one-process group of its own
        monkeypatch.delenv(var, raising=False)
    par = Parallelism(ParallelSpec(), precision, 1, False, recompute, attention="sdpa")
    rows = torch.randint(0, config.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    try:
        pm = ParallelModel(config, par, build_mesh(), "cpu")
        pm.init_weights()
        pm.forward_backward(rows[:, :-1], rows[:, 1:])
        stats = 0 if config.num_experts is None else config.num_layers * (config.num_experts + 2) * 4
        peak = measured_peak(pm, rows[:, :-1], rows[:, 1:], kept=stats)
    finally:
        shutdown()
    estimate = planner.rank_activations(config, par, 0, MICRO, SEQ)
    assert abs(estimate - peak) <= 0.25 * peak, (estimate, peak, estimate / peak)


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
    "num_kv_heads": 8, "ffn_hidden_size": 192, "max_seq_len": 256, "head_dim": 48, "q_lora_rank": 64,
    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
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
    T, hd, v, rope = micro * seq, shape["head_dim"], shape["v_head_dim"], shape["qk_rope_head_dim"]
    latent, q_lora = shape["kv_lora_rank"], shape["q_lora_rank"]
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

    from megacore.models.decoder import FastPaths, LatentAttention
    from megacore.models.rope import rope_tables

    shape = {**MLA, "q_lora_rank": q_lora_rank, "v_head_dim": v_head_dim}
    config, dtype = ModelConfig(**shape), {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
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
    shape = {**MLA, "q_lora_rank": q_lora_rank}
    config = ModelConfig(**shape)
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
    "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 96, "max_seq_len": 256, "attn_bias": True,
    "attn_out_bias": True, "mlp_bias": True, "attn_sinks": True, "activation": "clamped_swiglu",
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
    config = ModelConfig(**{**SHAPES["llama2-7b"], "max_seq_len": 1 << 17})

    def throughput(cp: int, seq: int, gpus_per_node: int = 8) -> float:
        par = Parallelism(ParallelSpec(cp=cp), "bf16", 1, False, "none")
        return planner.relative_throughput(config, par, 1, seq, gpus_per_node)

    assert throughput(1, 4096) == throughput(1, 1 << 17) == 1.0
    dp_cost = planner.DP_EFFICIENCY  # FSDP2 over cp's ranks
    assert throughput(8, 4096) < throughput(8, 1 << 17) < dp_cost
    assert throughput(8, 1 << 17) > 0.95 * dp_cost  # Llama 2 7B: 32 kv heads, 3% at 128k
    assert throughput(8, 4096, gpus_per_node=4) < throughput(8, 4096)


# --- Megatron-LLM's hardware table -----------------------------------------------------------------


# The models' published shapes (their Hugging Face config.json), sequence 4096.
LLAMA2 = {"family": "llama", "vocab_size": 32000, "norm_eps": 1e-5, "max_seq_len": 4096}
SHAPES = {
    "llama2-7b": {**LLAMA2, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32,
                  "ffn_hidden_size": 11008},
    "mistral-7b": {"family": "mistral", "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32,
                   "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336, "max_seq_len": 4096,
                   "norm_eps": 1e-5, "sliding_window": 4096},
    "falcon-40b": {"family": "falcon", "norm": "layernorm", "norm_bias": True, "activation": "gelu",
                   "tie_embeddings": True, "parallel_attn": True, "max_seq_len": 4096, "vocab_size": 65024,
                   "hidden_size": 8192, "num_layers": 60, "num_heads": 128, "num_kv_heads": 8,
                   "ffn_hidden_size": 32768, "num_ln_in_parallel_attn": 2},
    "llama2-70b": {**LLAMA2, "hidden_size": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8,
                   "ffn_hidden_size": 28672},
}  # fmt: skip


def preset_config(name: str, **changes) -> dict:
    return msgspec.to_builtins(ModelConfig(**{**SHAPES[name], **changes}))


# Megatron-LLM's FAQ ("What are the basic hardware requirements?"): full fine-tuning on 80 GB GPUs,
# world = tp x pp. Falcon 40B tied, as its config.json leaves it (FalconConfig's default): under pp
# the last stage holds a copy of the embedding as its output layer, as Megatron does.
FAQ = {
    "llama2-7b": (preset_config("llama2-7b"), 2, 1),
    "mistral-7b": (preset_config("mistral-7b"), 4, 1),
    "falcon-40b": (preset_config("falcon-40b"), 8, 2),
    "llama2-70b": (preset_config("llama2-70b"), 8, 4),
}


def faq_run(tmp_path: Path, tokens: Path, name: str, tp: int | None = None) -> tuple[Path, int]:
    config, faq_tp, pp = FAQ[name]
    tp, pp = (faq_tp, pp) if tp is None else (tp, 1)
    run_json = write_run(
        tmp_path / name,
        tokens,
        model={"config": config},
        batch={"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 4096},
        parallel={"tp": tp, "pp": pp},
        precision="bf16",
        recompute="none",
        attention="auto",
        eval={"every": 0},
    )
    return run_json, tp * pp


def dry_run(capsys, *argv: object) -> tuple[int, str, str]:
    from mega_train.cli import app
    from megacore.cli import run as run_cli

    code = run_cli(app, "mega-train", [str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(FAQ))
def test_megatron_llm_80gb_layouts_are_feasible_and_the_picks_are_named(
    name: str, tmp_path: Path, tokens: Path, capsys
) -> None:
    """bf16, sequence 4096, micro batch 1, AdamW, recompute none: each FAQ layout fits 80 GB with
    the allowance; the text names the planner's own best layouts of the same GPUs."""
    run_json, gpus = faq_run(tmp_path, tokens, name)
    argv = ["--manifest", run_json, "--dry-run", "--gpus", gpus, "--gpu-memory", "80GB"]
    code, out, err = dry_run(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    mem = plan["memory"]
    assert mem["fits"] is True and mem["peak"] + planner.ALLOWANCE <= 80 * GiB, mem
    _, tp, pp = FAQ[name]
    faq = [c for c in plan["layouts"]["candidates"] if (c["tp"], c["pp"], c["dp"]) == (tp, pp, 1)]
    assert len(faq) == 1 and faq[0]["fits"] and faq[0]["recompute"] == "none", faq
    picks = [c["label"] for c in plan["layouts"]["candidates"] if c["fits"]]
    code, text, err = dry_run(capsys, *argv)
    assert code == 0, err
    print(text)
    for label in picks[:3]:
        assert label in text
    assert "of 80.0 GiB: fits" in text


# --- docs/mega-train.md's planner table against closed forms from the models' published shapes ---------------

PAGE = Path(__file__).resolve().parents[2] / "docs" / "mega-train.md"  # its "How many GPUs" table
# The conditions the page's table states: sequence 4096, micro batch 1, global batch 64, no dp.
S, B, GLOBAL_BATCH = 4096, 1, 64


@dataclass(frozen=True)
class Published:
    """A model's shapes as its Hugging Face config.json publishes them."""

    readme: str  # its name in the page's table
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int  # a multiple of 128 for all four: mega-convert's padding (`pad_vocab`) adds no rows
    swiglu: bool  # gate, up and down projections; else up and down (GELU)
    norm_tensors: int  # per norm: RMSNorm a weight; LayerNorm a weight and a bias


PUBLISHED = {
    # meta-llama/Llama-2-7b-hf config.json
    "llama2-7b": Published("Llama 2 7B", 4096, 32, 32, 32, 11008, 32000, True, 1),
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral-7b": Published("Mistral 7B", 4096, 32, 32, 8, 14336, 32000, True, 1),
    # tiiuae/falcon-40b config.json (new_decoder_architecture: ln_attn and ln_mlp, LayerNorms with
    # bias; bias false elsewhere); no ffn key: FalconConfig's MLP is 4 x hidden. Tied: under pp 2 the
    # last stage's copy of the embedding counts as a head would (the closed form's `last * table`).
    "falcon-40b": Published("Falcon 40B", 8192, 60, 128, 8, 4 * 8192, 65024, False, 2),
    # meta-llama/Llama-2-70b-hf config.json
    "llama2-70b": Published("Llama 2 70B", 8192, 80, 64, 8, 28672, 32000, True, 1),
}

_LAYOUT = r"tp (\d+)(?: × pp (\d+))?"
_ROW = re.compile(rf"\| ([^|]+?) \| {_LAYOUT} \((\d+)(?: GPUs)?\) \| (\d+\.\d) \+ (\d+) GiB \| {_LAYOUT} \|")


def readme_planner_table() -> dict[str, dict]:
    """docs/mega-train.md's "How many GPUs: TP and PP" table by model: layout, GPUs, peak and allowance (GiB),
    the planner's first pick. Every row must parse, so none can drop out of the test unnoticed."""
    section = PAGE.read_text().split("## How many GPUs: TP and PP\n", 1)[1].split("\n## ", 1)[0]
    lines = section[section.index("| model | layout | peak rank |") :].splitlines()[2:]
    body = list(itertools.takewhile(lambda line: line.startswith("|"), lines))
    table = {}
    for line in body:
        m = _ROW.fullmatch(line)
        assert m, f"docs/mega-train.md planner table: cannot parse {line!r}"
        name, tp, pp, gpus, peak, allowance, pick_tp, pick_pp = m.groups()
        table[name] = {
            "layout": (int(tp), int(pp or 1)),
            "gpus": int(gpus),
            "peak": float(peak),
            "allowance": int(allowance),
            "pick": (int(pick_tp), int(pick_pp or 1)),
        }
    return table


def closed_form_stages(m: Published, tp: int, pp: int) -> list[dict]:
    """Per pipeline stage: the state bytes of a tp rank and its activations at the 1F1B peak."""
    hd = m.hidden // m.heads
    # Megatron's split: q, k, v, gate, up by rows, o and down by columns, embedding and head by
    # vocab rows, all / tp (each divides); norms replicated.
    matrices = 2 * m.hidden**2 + 2 * m.kv_heads * hd * m.hidden + (3 if m.swiglu else 2) * m.hidden * m.ffn
    assert matrices % tp == 0 and m.vocab % tp == 0 and m.layers % pp == 0
    layer_params = matrices // tp + 2 * m.norm_tensors * m.hidden
    layer_tensors = 2 * m.norm_tensors + 4 + (3 if m.swiglu else 2)
    table = m.vocab * m.hidden // tp
    # Korthikanti et al. 2022, eq. 2 (tp, no sequence parallel): s·b·h·(10 + 24/t + 5as/(ht)). The
    # 5as/(ht) term is the a·s² scores, softmax and dropout mask; FlashAttention (models/attention.py)
    # keeps none, which leaves the paper's selective-recompute form s·b·h·(10 + 24/t).
    per_layer = S * B * m.hidden * (10 * tp + 24) // tp
    # Section 4.3, last stage: the final norm's and output projection's inputs, fp32 logits / t.
    output = 4 * S * B * m.hidden + 4 * S * B * m.vocab // tp
    microbatches = GLOBAL_BATCH // B
    stages = []
    for r in range(pp):
        first, last = r == 0, r == pp - 1
        n = m.layers // pp * layer_params + first * table + last * (m.norm_tensors * m.hidden + table)
        tensors = m.layers // pp * layer_tensors + first + last * (m.norm_tensors + 1)
        state = {
            "weights": 4 * n,  # fp32 master weights
            # fp32 grads; the engine's DTensor backward leaves the whole embedding gradient on every
            # tp rank (planner/memory.py's docstring; Megatron keeps it sharded): (tp - 1)/tp more of it.
            "grads": 4 * n + first * 4 * (m.vocab * m.hidden - table),
            "optimizer": 8 * n + 4 * tensors,  # exp_avg, exp_avg_sq; torch's fp32 step per tensor
            "copies": 2 * n,  # bf16 compute copies, held when dp is 1
        }
        # 1F1B: stage r holds min(m, pp - r) microbatches at its peak (pp on the first).
        in_flight = min(microbatches, pp - r)
        activations = in_flight * (m.layers // pp * per_layer + last * output)
        stages.append({"state": state, "total": sum(state.values()) + activations})
    return stages


PEAK_TOLERANCE = 0.10  # of the closed form; see the test's docstring


@pytest.mark.parametrize("name", sorted(FAQ))
def test_the_planner_table_matches_closed_forms_of_the_published_shapes(
    name: str, tmp_path: Path, tokens: Path, capsys
) -> None:
    """The page's row for each FAQ layout: its layout, peak and first pick are the planner's; the
    planner's state bytes on every stage equal, to the byte, those worked out here from the model's
    published shapes; and the peak is within 10% of that state plus Korthikanti's activations on
    the worst stage. The closed form leaves out what the planner adds (pipeline receive buffers,
    transient gradients and logits copies) and assumes a 4h GELU MLP with full-width K/V (SwiGLU
    saves more, GQA less): the page's peaks sit 5.2% below (Falcon 40B) to 3.8% above it."""
    m = PUBLISHED[name]
    table = readme_planner_table()
    assert set(table) == {p.readme for p in PUBLISHED.values()}, sorted(table)
    row = table[m.readme]
    _, tp, pp = FAQ[name]
    assert row["layout"] == (tp, pp) and row["gpus"] == tp * pp, row
    assert row["allowance"] * GiB == planner.ALLOWANCE

    run_json, gpus = faq_run(tmp_path, tokens, name)
    argv = ["--manifest", run_json, "--dry-run", "--gpus", gpus, "--gpu-memory", "80GB", "--json"]
    code, out, err = dry_run(capsys, *argv)
    assert code == 0, err
    plan = json.loads(out)
    mem = plan["memory"]
    assert (mem["micro_batch_size"], mem["seq_length"], mem["microbatches"]) == (B, S, GLOBAL_BATCH // B)
    # The published figures are the planner's, as the dry run prints them (0.1 GiB).
    assert f"{mem['peak'] / GiB:.1f}" == f"{row['peak']:.1f}", (mem["peak"] / GiB, row)
    first = next(c for c in plan["layouts"]["candidates"] if c["fits"])
    assert (first["tp"], first["pp"]) == row["pick"], (first["label"], row)

    stages = closed_form_stages(m, tp, pp)
    assert [r["pp_rank"] for r in mem["ranks"]] == list(range(pp)), mem["ranks"]
    for r, expected in zip(mem["ranks"], stages, strict=True):
        assert {k: r[k] for k in expected["state"]} == expected["state"], (r["pp_rank"], r)
    worst = max(range(pp), key=lambda s: stages[s]["total"])
    assert max(mem["ranks"], key=lambda r: r["total"])["pp_rank"] == worst
    independent = stages[worst]["total"]
    assert abs(row["peak"] * GiB - independent) <= PEAK_TOLERANCE * independent, (
        row["peak"],
        independent / GiB,
        row["peak"] * GiB / independent - 1,
    )


def test_a_7b_full_fine_tune_does_not_fit_one_80gb_gpu(tmp_path: Path, tokens: Path, capsys) -> None:
    """18 bytes per parameter of state alone (fp32 weights, grads, two moments, bf16 copies) is
    about 113 GiB for Llama 2 7B: no recompute makes one GPU enough."""
    run_json, _ = faq_run(tmp_path, tokens, "llama2-7b", tp=1)
    code, out, err = dry_run(
        capsys, "--manifest", run_json, "--dry-run", "--gpus", 1, "--gpu-memory", "80GB", "--json"
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["memory"]["fits"] is False
    (only,) = plan["layouts"]["candidates"]
    assert not only["fits"] and only["recompute"] == "full" and only["peak"] > 100 * GiB


# --- the command line ------------------------------------------------------------------------------


def test_parse_size() -> None:
    from mega_train.cli import parse_size

    assert parse_size("80GB") == parse_size("80G") == parse_size("80GiB") == 80 * GiB
    assert parse_size("81920MiB") == 80 * GiB
    assert parse_size("1.5T") == 1536 * GiB
    assert parse_size("4096B") == 4096
    for bad in ("banana", "80 GB of HBM", "-80GB", "0GB", "", "4096"):
        with pytest.raises(UserError, match="--gpu-memory"):
            parse_size(bad)


def test_bad_planning_flags_are_one_line_errors(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(tmp_path, tokens)
    base = ["--manifest", run_json]
    assert_one_line_error(
        run_in_process("mega-train", *base, "--dry-run", "--gpu-memory", "banana"), "--gpu-memory", "'banana'"
    )
    assert_one_line_error(
        run_in_process("mega-train", *base, "--dry-run", "--gpu-memory", "80"),
        "--gpu-memory: 80 has no unit: did you mean 80GB?",
    )
    assert_one_line_error(
        run_in_process("mega-train", *base, "--gpus", "8", "--gpu-memory", "80GB"), "--dry-run"
    )
    assert_one_line_error(
        run_in_process("mega-train", *base, "--dry-run", "--gpus", "8"), "--gpus", "--gpu-memory"
    )
    assert_one_line_error(
        run_in_process(
            "mega-train", *base, "--dry-run", "--gpus", "8", "--world-size", "8", "--gpu-memory", "80GB"
        ),
        "--gpus",
        "--world-size",
    )


def test_precision_takes_the_dtype_options_spelling(tmp_path: Path, tokens: Path) -> None:
    """`"precision": "bfloat16"`, as the tools' --dtype spell it, is bf16: the same plan as "bf16"."""
    plans = {}
    for spelling in ("bf16", "bfloat16"):
        run_json = write_run(tmp_path / spelling, tokens, precision=spelling)
        proc = run_in_process("mega-train", "--manifest", run_json, "--dry-run", "--json", check=True)
        plans[spelling] = json.loads(proc.stdout)["memory"]
    assert plans["bfloat16"]["precision"] == "bf16" and plans["bfloat16"] == plans["bf16"]


def test_the_plan_needs_no_torch(tmp_path: Path, tokens: Path) -> None:
    """The dry run with the memory plan and the layout search, in a fresh interpreter, imports no torch."""
    run_json = write_run(tmp_path, tokens, parallel={"tp": 2, "pp": 2})
    proc = dry_run_without_torch("--manifest", run_json, "--dry-run", "--gpus", "8", "--gpu-memory", "1GB")
    assert "memory per rank" in proc.stdout and "layouts of 8 GPUs of 1.0 GiB" in proc.stdout


# Llama 2 7B's config.json as the Hub publishes it (meta-llama/Llama-2-7b-hf).
LLAMA2_7B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


def test_a_model_not_downloaded_is_planned_from_its_config_json(tmp_path: Path, tokens: Path) -> None:
    """`"model": {"hf_config": ...}` (a model directory holding only its config.json): in a fresh
    interpreter without torch, the dry run plans the model that config.json describes: the same
    plan, to the byte, as the one of Llama 2 7B's shape written out by hand (`SHAPES`), and a
    note that its weights are not read."""
    model = tmp_path / "Llama-2-7b-hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG_JSON))
    runs = {
        key: write_run(
            tmp_path / key,
            tokens,
            model=model_spec,
            precision="bf16",
            attention="auto",
            eval={"every": 0},
            batch={"micro_batch_size": B, "global_batch_size": GLOBAL_BATCH, "seq_length": S},
        )
        for key, model_spec in (
            ("hf", {"config": None, "hf_config": str(model)}),
            ("by-hand", {"config": {**SHAPES["llama2-7b"], "bos_id": 1, "eos_id": 2}}),
        )
    }
    argv = ("--dry-run", "--gpus", "8", "--gpu-memory", "80GB", "--json")
    from_hf = json.loads(dry_run_without_torch("--manifest", runs["hf"], *argv).stdout)
    assert any("its weights are not read" in note for note in from_hf["notes"]), from_hf["notes"]
    by_hand = json.loads(
        run_in_process("mega-train", "--manifest", runs["by-hand"], *argv, check=True).stdout
    )
    assert from_hf["model"] == by_hand["model"] and from_hf["model"]["parameters"] == 6_738_415_616
    # The compile note of a plan for GPUs speaks of GPUs, not of this machine's CPU.
    assert "compile auto: compiles the blocks on the GPUs" in from_hf["notes"], from_hf["notes"]
    assert from_hf["memory"] == by_hand["memory"] and from_hf["layouts"] == by_hand["layouts"]


# Mistral 7B v0.1's config.json as the Hub publishes it (mistralai/Mistral-7B-v0.1).
MISTRAL_7B_CONFIG_JSON = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


def test_the_readme_tour_prints_the_planners_plan(tmp_path: Path, tokens: Path, capsys, monkeypatch) -> None:
    """README's tour shows what its dry run prints for Mistral 7B: the same command on the tour's
    run.json, the model given by its published config.json (the weights change nothing the plan
    counts), prints every line the tour shows (in order; the lines it leaves out between them)."""
    from test_readme_tour import README as TOUR_README
    from test_readme_tour import tour

    commands, run = tour(TOUR_README.read_text())
    dry = next(c for c in commands if c.kind == "mega-train --dry-run")
    model = tmp_path / "Mistral-7B-v0.1"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MISTRAL_7B_CONFIG_JSON))
    run = {
        **run,
        "model": {"hf_config": str(model)},
        "data": {**run["data"], "sources": [{"path": str(tokens)}]},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    monkeypatch.chdir(tmp_path)
    code, out, err = dry_run(capsys, *dry.line.split()[1:])
    assert code == 0, err
    printed = iter(out.splitlines())
    for line in dry.printed:
        assert any(got == line for got in printed), (
            f"README tour: {line!r} is not what the dry run prints:\n{out}"
        )


# Mixtral 8x7B's published shape (its config.json).
MIXTRAL_8X7B = {
    "family": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
    "num_kv_heads": 8, "ffn_hidden_size": 14336, "max_seq_len": 32768, "norm_eps": 1e-5,
    "rope_theta": 1e6, "num_experts": 8, "experts_per_token": 2,
}  # fmt: skip


def test_the_mixtral_layouts_quoted_are_the_planners(tmp_path: Path, tokens: Path, capsys) -> None:
    """docs/mega-train.md's Mixtral 8x7B figures (the dense table's batch and conditions) are the planner's: on
    16 GPUs its first pick and the first expert-parallel layout; on 8 that none fits, the
    smallest peak, and the fp32 weights, gradients and AdamW moments per GPU worked out here
    (16 bytes a parameter)."""
    text = " ".join(PAGE.read_text().split())
    picks = {}
    for gpus in (16, 8):
        run_json = write_run(
            tmp_path / str(gpus), tokens, model={"config": MIXTRAL_8X7B},
            batch={"micro_batch_size": B, "global_batch_size": GLOBAL_BATCH, "seq_length": S},
            parallel={"pp": gpus}, precision="bf16", recompute="none", attention="auto", eval={"every": 0},
        )  # fmt: skip
        argv = ["--manifest", run_json, "--dry-run", "--gpus", gpus, "--gpu-memory", "80GB", "--json"]
        code, out, err = dry_run(capsys, *argv)
        assert code == 0, err
        picks[gpus] = json.loads(out)["layouts"]["candidates"]
    first = picks[16][0]
    assert first["fits"] and first["ep"] == 1, first
    assert (
        f"first pick is tp {first['tp']} × pp {first['pp']} without recompute ({first['peak'] / GiB:.1f} + 4 GiB)"
        in text
    )
    ep = next(c for c in picks[16] if c["ep"] > 1)
    assert ep["fits"] and ep["recompute"] == "full" and ep["pp"] == 1, ep
    assert f"tp {ep['tp']} × dp {ep['dp']} with ep {ep['ep']} first ({ep['peak'] / GiB:.1f} + 4 GiB)" in text
    assert not any(c["fits"] for c in picks[8])
    least = min((c for c in picks[8] if c["peak"]), key=lambda c: c["peak"])
    assert f"smallest peak is {least['peak'] / GiB:.1f} GiB, tp {least['tp']} with full recompute" in text
    assert (least["pp"], least["recompute"]) == (1, "full"), least
    params = sum(math.prod(s) for s in model_tensors(ModelConfig(**MIXTRAL_8X7B)).values())
    assert f"{params / 1e9:.1f}B parameters" in text
    assert f"alone are {16 * params / 8 / GiB:.1f} GiB per GPU" in text


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


# --- docs/mega-train.md's LoRA and QLoRA rows -------------------------------------------------------

# The page's conditions (the full fine-tuning table's batch): rank 16 (alpha 32) on every projection
# the family has of these (Mixtral: its attention), dropout 0.
LORA_MODELS = {
    "Llama 2 7B": SHAPES["llama2-7b"],
    "Llama 2 70B": SHAPES["llama2-70b"],
    "Mixtral 8×7B": MIXTRAL_8X7B,
}
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_ROW = re.compile(
    rf"\| ([^|]+?) \| (LoRA|QLoRA) \| (\d+) \| {_LAYOUT}, recompute (\w+) \| (\d+\.\d) \+ (\d+) GiB \|"
)


def lora_parallelism(config: ModelConfig, nf4: bool) -> Parallelism:
    """The page's LoRA (QLoRA: `nf4`) settings, its modules resolved as the run plan resolves them."""
    from megacore.config import LoRA
    from megacore.models import adapters

    targets = tuple(t for t in PROJECTIONS if t in adapters.targetable(config))
    lora = LoRA(LORA_RANK, 2.0 * LORA_RANK, targets, base_dtype="nf4" if nf4 else None,
                modules=tuple(adapters.modules(config, targets)))  # fmt: skip
    return Parallelism(ParallelSpec(), "bf16", 1, attention="auto", lora=lora)


def fewest_gpus(config: ModelConfig, nf4: bool) -> tuple[int, planner.Candidate]:
    """The fewest 80 GB GPUs (a power of 2) on which a layout fits, and the planner's first pick there."""
    for gpus in (1, 2, 4, 8, 16, 32):
        found = planner.search(
            config, lora_parallelism(config, nf4), gpus, 80 * GiB, B, S, GLOBAL_BATCH, "auto"
        )
        if found[0].fits:
            return gpus, found[0]
    raise AssertionError(f"nothing fits 32 GPUs: {config}")


def lora_table() -> dict[tuple[str, str], dict]:
    """The page's LoRA and QLoRA rows by (model, method); every row must parse."""
    section = PAGE.read_text().split("## How many GPUs: TP and PP\n", 1)[1].split("\n## ", 1)[0]
    lines = section[section.index("| model | fine-tuning | GPUs |") :].splitlines()[2:]
    table = {}
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines):
        m = _LORA_ROW.fullmatch(line)
        assert m, f"docs/mega-train.md LoRA table: cannot parse {line!r}"
        name, method, gpus, tp, pp, recompute, peak, allowance = m.groups()
        table[name, method] = {"gpus": int(gpus), "layout": (int(tp), int(pp or 1)), "recompute": recompute,
                               "peak": float(peak), "allowance": int(allowance)}  # fmt: skip
    return table


def nf4_closed_form(n: int) -> int:
    """QLoRA's bytes of an n-value weight: 4-bit codes, an int8 scale per 64 values, an fp32 factor
    per 256 scales, and the scales' fp32 mean with the 16 codes' fp32 values."""
    return n // 2 + n // 64 + 4 * (n // (64 * 256)) + 4 * 17


def lora_closed_form_state(shape: dict, nf4: bool, tp: int, pp: int, r: int) -> dict:
    """Pipeline rank r's state bytes (one process per stage, no dp: compute copies), from the
    published shapes: the frozen base in bf16 (QLoRA: the dense projections in NF4), the adapters
    fp32 with gradients, AdamW moments (and a step per tensor) and bf16 copies. Under tp the
    projections split as Megatron's (q, k, v, gate, up by rows; o, down by columns; the experts'
    ffn), the router and norms replicated; the adapters with them: B on its rows for the former, A
    on its columns for the latter, the other whole."""
    h, f, vocab = shape["hidden_size"], shape["ffn_hidden_size"], shape["vocab_size"]
    kv, experts = shape["num_kv_heads"] * h // shape["num_heads"], shape.get("num_experts")
    # (in, out, split on the output rows) of each projection of a layer
    attn = [(h, h, True), (h, kv, True), (h, kv, True), (h, h, False)]
    mlp = [] if experts else [(h, f, True), (h, f, True), (f, h, False)]
    layers = shape["num_layers"] // pp
    projections = [(i * o) // tp for i, o, _ in attn + mlp]
    other = 2 * h + (experts * h + 3 * experts * f * h // tp if experts else 0)  # norms, router, experts
    frozen = 2 * other + sum(nf4_closed_form(n) if nf4 else 2 * n for n in projections)
    table = vocab * h // tp
    base = layers * frozen + 2 * table * (r == 0) + (2 * table + 2 * h) * (r == pp - 1)
    adapters = sum(
        LORA_RANK * i + (o // tp) * LORA_RANK if rows else LORA_RANK * (i // tp) + o * LORA_RANK
        for i, o, rows in attn + mlp
    )
    trained, tensors = layers * adapters, layers * 2 * len(attn + mlp)
    return {"weights": base + 4 * trained, "grads": 4 * trained, "optimizer": 8 * trained + 4 * tensors,
            "copies": 2 * trained}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LORA_MODELS))
def test_the_lora_table_is_the_planners_and_its_state_a_closed_form(name: str) -> None:
    """Each LoRA and QLoRA row: the fewest GPUs that fit (none fits on half as many), the planner's
    first pick and its peak, as the planner gives them; and the pick's state bytes on every stage
    equal, to the byte, those worked out here from the model's published shapes."""
    table = lora_table()
    assert {n for n, _ in table} == set(LORA_MODELS), sorted(table)
    config = ModelConfig(**LORA_MODELS[name])
    for method in ("LoRA", "QLoRA"):
        row, nf4 = table[name, method], method == "QLoRA"
        gpus, pick = fewest_gpus(config, nf4)
        assert (row["gpus"], row["layout"], row["recompute"]) == (
            gpus,
            (pick.dims.tp, pick.dims.pp),
            pick.recompute,
        )
        assert (
            f"{pick.peak / GiB:.1f}" == f"{row['peak']:.1f}" and row["allowance"] * GiB == planner.ALLOWANCE
        )
        par = planner.candidate_parallelism(
            lora_parallelism(config, nf4), pick.dims, pick.microbatches, pick.recompute
        )
        ranks = planner.estimate(config, par, pick.dims.dp, B, S, "auto")
        for rank in ranks:
            want = lora_closed_form_state(LORA_MODELS[name], nf4, pick.dims.tp, pick.dims.pp, rank.pp_rank)
            got = {k: getattr(rank, k) for k in want}
            assert got == want, (method, rank.pp_rank, got, want)


# --- docs/mega-train.md's rows for the largest mixtures of experts ------------------------------------

# deepseek-ai/DeepSeek-V3's config.json as the Hub publishes it (its multi-token-prediction layer,
# num_nextn_predict_layers, is not trained here: mega-convert leaves it out).
DEEPSEEK_V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


# openai/gpt-oss-120b's config.json as the Hub publishes it; gpt-oss-20b's differs in its layers
# (24) and experts (32). Its MXFP4 experts are trained here in bf16 (mega-convert dequantizes them).
def gpt_oss_config_json(layers: int, experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"],
                                "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
        "vocab_size": 201088,
    }  # fmt: skip


# A parameter of a rank: its tp-local shape, the dim FSDP2 cuts, whether it trains (else its weights alone).
Param = tuple[tuple[int, ...], int, bool]


@dataclass(frozen=True)
class PublishedMoE:
    """A mixture of experts as its config.json publishes it: the vocab and hidden size (untied
    embedding and head, split by tp on the vocab), its layers, and a layer's parameters on a tp
    rank (`layer(tp, i)`)."""

    config_json: dict
    vocab: int
    hidden: int
    layers: int
    layer: Callable[[int, int], list[Param]]

    def stage(self, tp: int, pp: int, r: int) -> list[Param]:
        """Pipeline stage r's parameters of pp even stages: the embedding first, the norm and head last."""
        assert self.layers % pp == 0 and self.vocab % tp == 0
        table = ((self.vocab // tp, self.hidden), 0, True)
        per = self.layers // pp
        out = [table] if r == 0 else []
        out += [p for i in range(r * per, (r + 1) * per) for p in self.layer(tp, i)]
        return out + ([((self.hidden,), 0, True), table] if r == pp - 1 else [])


def deepseek_v3_layer(tp: int, i: int) -> list[Param]:
    """DeepSeek V3's layer i on a tp rank: latent attention (q's rank-1536 pair, the rank-512
    latent and a 64-wide rope part, 128 heads of 128 + 64, v of 128; the per-head expansions split
    by head, the latent projections and norms whole); the first 3 layers' MLP dense (18432), the
    others 256 experts of 2048 (each expert's ffn split by tp; FSDP2 cuts gate/up's hidden dim
    under tp, their ffn dim without, down's hidden dim), a router and its balancing bias (moved by
    the engine, no gradient) and one shared expert."""
    h, heads, q_lora, latent, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    attention = [(h,), (q_lora, h), (q_lora,), (heads * (nope + rope) // tp, q_lora), (latent + rope, h),
                 (latent,), (heads * (nope + v) // tp, latent), (h, heads * v // tp), (h,)]  # fmt: skip
    out = [(s, 0, True) for s in attention]  # attention, its norm and the MLP's norm
    if i < 3:
        f = 18432 // tp
        return [*out, ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]
    e, f, gate_up = 256, 2048 // tp, 2 if tp > 1 else 1
    return [*out, ((e,), 0, False), ((e, h), 0, True), ((e, f, h), gate_up, True), ((e, f, h), gate_up, True),
            ((e, h, f), 1, True), ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]  # fmt: skip


def gpt_oss_layer(experts: int) -> Callable[[int, int], list[Param]]:
    """gpt-oss's layer on a tp rank: 64 q heads and 8 kv heads of 64 (q/k/v split by head with their
    biases, o by its columns, o's bias whole), a sink per q head (split with them), `experts`
    experts of 2880 with biases (each expert's ffn split by tp, gate's and up's biases with it,
    down's whole; FSDP2 cuts their weights as DeepSeek V3's, the biases' experts), a router with
    its bias."""

    def layer(tp: int, i: int) -> list[Param]:
        h, q, kv, e, f = 2880, 64 * 64 // tp, 8 * 64 // tp, experts, 2880 // tp
        gate_up = 2 if tp > 1 else 1
        attention = [(h,), (q, h), (q,), (kv, h), (kv,), (kv, h), (kv,), (h, q), (h,), (64 // tp,), (h,)]
        out = [(s, 0, True) for s in attention]  # attention, its sinks, the norms
        out += [((e, h), 0, True), ((e,), 0, True)]  # the router
        out += 2 * [((e, f, h), gate_up, True), ((e, f), 0 if tp > 1 else 1, True)]  # gate, up
        return [*out, ((e, h, f), 1, True), ((e, h), 1, True)]  # down

    return layer


MOE_MODELS = {
    "DeepSeek V3 671B": PublishedMoE(DEEPSEEK_V3_CONFIG_JSON, 129280, 7168, 61, deepseek_v3_layer),
    "gpt-oss 120B": PublishedMoE(gpt_oss_config_json(36, 128), 201088, 2880, 36, gpt_oss_layer(128)),
    "gpt-oss 20B": PublishedMoE(gpt_oss_config_json(24, 32), 201088, 2880, 24, gpt_oss_layer(32)),
}


def closed_form_full_state(m: PublishedMoE, tp: int, pp: int, r: int, dp: int) -> dict:
    """Stage r's state on replica 0 (no ep), FSDP2 over dp: each parameter's dim cut in dp chunks of
    ceil(rows / dp) rows, replica 0 holding a whole one; fp32 weights, and of the trained ones fp32
    gradients, AdamW's two moments and a step per tensor. Where dp is 1, bf16 compute copies (a
    parameter without a gradient then in bf16 alone), and under tp the embedding's gradient whole
    on every tp rank (the engine's DTensor backward: planner/memory.py's docstring)."""
    trained = frozen = tensors = 0
    for shape, dim, trains in m.stage(tp, pp, r):
        n = -(-shape[dim] // dp) * math.prod(shape) // shape[dim]
        trained, frozen, tensors = trained + n * trains, frozen + n * (not trains), tensors + trains
    copies = dp == 1
    whole = m.vocab * m.hidden * (tp - 1) // tp if copies and r == 0 else 0
    return {"weights": 4 * trained + (2 if copies else 4) * frozen, "grads": 4 * (trained + whole),
            "optimizer": 8 * trained + 4 * tensors, "copies": 2 * trained if copies else 0}  # fmt: skip


FULL_FINE_TUNING = Parallelism(ParallelSpec(), "bf16", 1, attention="auto")  # FSDP2 over dp, 1F1B


def moe_config(name: str) -> ModelConfig:
    """A model of the page's mixtures of experts as mega-convert reads its config.json."""
    from megacore.models.families import config_from_hf

    return config_from_hf(MOE_MODELS[name].config_json)


@functools.cache
def fewest_full_gpus(name: str) -> tuple[int, planner.Candidate]:
    """The fewest 80 GB GPUs (a power of 2) on which a full fine-tuning layout of the page's batch
    fits, and the planner's first pick there."""
    config = moe_config(name)
    for gpus in (1 << i for i in range(11)):
        found = planner.search(config, FULL_FINE_TUNING, gpus, 80 * GiB, B, S, GLOBAL_BATCH, "auto")
        if found[0].fits:
            return gpus, found[0]
    raise AssertionError(f"nothing fits 1024 GPUs: {name}")


def pick_label(pick: planner.Candidate) -> str:
    """A layout as the page writes it: tp, then pp, cp and dp where above 1, ep where above 1."""
    d = pick.dims
    rest = [f"{n} {k}" for n, k in (("pp", d.pp), ("cp", d.cp), ("dp", d.dp)) if k > 1]
    return " × ".join([f"tp {d.tp}", *rest]) + (f" with ep {d.ep}" if d.ep > 1 else "")


_MOE_ROW = re.compile(
    r"\| ([^|]+?) \| (\d+\.\d)B \| (\d+) \| (tp \d+(?: × (?:pp|cp|dp) \d+)*(?: with ep \d+)?), recompute (\w+)"
    r" \| (\d+\.\d) \+ (\d+) GiB \| (\d+\.\d) GiB \|"
)


def moe_table() -> dict[str, dict]:
    """The page's rows for the largest mixtures of experts, by model; every row must parse."""
    section = PAGE.read_text().split("## How many GPUs: TP and PP\n", 1)[1].split("\n## ", 1)[0]
    lines = section[section.index("| model | parameters | GPUs |") :].splitlines()[2:]
    table = {}
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines):
        m = _MOE_ROW.fullmatch(line)
        assert m, f"docs/mega-train.md mixture of experts table: cannot parse {line!r}"
        name, params, gpus, layout, recompute, peak, allowance, half = m.groups()
        table[name] = {"params": params, "gpus": int(gpus), "layout": layout, "recompute": recompute,
                       "peak": peak, "allowance": int(allowance), "half": half}  # fmt: skip
    return table


def moe_parameters(name: str) -> tuple[int, int]:
    """(every parameter, the trained ones) of a model of MOE_MODELS, from its published shapes."""
    params = MOE_MODELS[name].stage(1, 1, 0)
    return sum(math.prod(s) for s, _, _ in params), sum(math.prod(s) for s, _, trains in params if trains)


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_the_moe_table_is_the_planners_and_its_state_a_closed_form(name: str) -> None:
    """Each row of the page's mixtures of experts (full fine-tuning, the dense table's batch and
    conditions): the parameters, worked out here from the published config, are the converter's
    reading's; the fewest GPUs that fit, the first pick and its peak are the planner's; the pick's
    state bytes on every stage equal, to the byte, those worked out here; and on half as many GPUs
    none can fit, by the closed form: the fp32 weights, gradients and AdamW moments alone (16 bytes
    a trained parameter, at least, on the fullest rank) exceed a GPU less the allowance."""
    table = moe_table()
    assert set(table) == set(MOE_MODELS), sorted(table)
    row, m, config = table[name], MOE_MODELS[name], moe_config(name)
    total, trained = moe_parameters(name)
    assert total == sum(math.prod(s) for s in model_tensors(config).values())
    assert f"{total / 1e9:.1f}" == row["params"]
    gpus, pick = fewest_full_gpus(name)
    assert (row["gpus"], row["layout"], row["recompute"]) == (gpus, pick_label(pick), pick.recompute)
    assert f"{pick.peak / GiB:.1f}" == row["peak"] and row["allowance"] * GiB == planner.ALLOWANCE
    assert pick.dims.ep == pick.dims.cp == 1, pick.label  # the closed form's case
    par = planner.candidate_parallelism(FULL_FINE_TUNING, pick.dims, pick.microbatches, pick.recompute)
    ranks = planner.estimate(config, par, pick.dims.dp, B, S, "auto", all_dp_ranks=False)
    assert [r.pp_rank for r in ranks] == list(range(pick.dims.pp))
    for rank in ranks:
        want = closed_form_full_state(m, pick.dims.tp, pick.dims.pp, rank.pp_rank, pick.dims.dp)
        assert {k: getattr(rank, k) for k in want} == want, rank.pp_rank
        assert rank.state <= rank.total <= pick.peak <= 80 * GiB - planner.ALLOWANCE
    half = 16 * trained / (gpus // 2)
    assert half > 80 * GiB - planner.ALLOWANCE and f"{half / GiB:.1f}" == row["half"]
