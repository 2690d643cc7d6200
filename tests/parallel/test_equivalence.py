"""The same model split over processes computes what one process computes.

Real processes under torchrun on gloo (OMP_NUM_THREADS=1); each launch runs several scenarios, and
every rank checks against the single-process reference it computes itself (dist_worker.py): first
step loss, every gradient, the global gradient norm and the gradients after `clip_grad_norm` with a
max_norm that really clips (against torch's clip_grad_norm_ on the reference), then the parameters
after three AdamW steps, all in fp32 within 1e-5 relative (norm-wise; bf16 mixed precision within
3e-2, under FSDP2 with dp and through bf16 compute copies without). Llama (GQA, padded vocab; and 8 heads over 2 kv heads, replicated under tp 4), Falcon 7B style
(parallel attention, multi-query, tied embeddings), Falcon 40B style (two norms, kv groups, biases)
and Mistral (sliding window), and tied embeddings under pp (Falcon 40B's architecture tied, Llama 3.2
style), Qwen 2 (q/k/v biases, tied), Qwen 3 (per-head q/k norms) and Gemma 3 (sandwich (1 + w)
norms, scaled embeddings, local and global layers, tied); tp, pp, dp and their
combinations, sequence parallel on and off, all five pipeline schedules (1F1B also with more
microbatches than stages), FSDP2 and replicate, a checkpoint saved by one layout and resumed under
another, and packed documents with ignored targets (the loss a mean over the counted targets of the
whole batch) under dp, tp, pp and tp x pp. Context parallel alone (cp 2 and 4, one token per chunk)
and with tp + SP, pp (1F1B, ZBV, interleaved, GPipe; tied embeddings), dp (FSDP2 over dp x cp),
packed documents, windows and bf16, and a checkpoint saved at cp 2 resumed at cp 1. Mixtures of
experts (Mixtral; Qwen 2 MoE's dense layer and gated shared expert; DeepSeek V3's latent attention,
grouped sigmoid routing and balancing bias) under ep, tp, pp, cp and their combinations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_bitwise_equal, torchrun_script
from mega_shard.reshard import reshard
from megacore.artifacts import TensorReader, open_artifact

WORKER = Path(__file__).with_name("dist_worker.py")


def launch(tmp_path: Path, nproc: int, scenarios: list[dict]) -> list[str]:
    spec = tmp_path / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    proc = torchrun_script(nproc, WORKER, spec)
    passed = [line for line in proc.stdout.splitlines() if line.startswith("PASS ")]
    assert len(passed) == len(scenarios), proc.stdout
    return passed


# Each launch runs its scenarios one after another. `make test` runs one scenario per capability
# (CORE_*); the rest of the matrix, other combinations of what CORE covers, runs with `make
# test-slow` (MORE_*). Scenarios that save and load a checkpoint stay in one launch.
def two_process_core(ckpt: Path, tied: Path, lora: Path) -> list[dict]:
    return [
        {"family": "llama", "tp": 2, "sp": True},
        {"family": "llama", "save": str(ckpt)},  # dp 2, FSDP2: every rank writes its shards
        {"family": "llama", "pp": 2, "schedule": "1f1b", "load": str(ckpt)},
        {"family": "llama", "pp": 2, "schedule": "zbv"},
        {"family": "llama", "precision": "bf16"},  # FSDP2 bf16 compute, fp32 master: 3e-2
        # Without dp: bf16 compute copies (a pipeline stage's).
        {"family": "llama", "pp": 2, "schedule": "1f1b", "precision": "bf16"},
        {"family": "falcon", "tp": 2, "sp": True},  # multi-query, tied at pp 1
        {"family": "mistral", "pp": 2, "schedule": "1f1b"},  # a window shorter than the sequence
        # Packed documents, some targets ignored: dp ranks counting different numbers of
        # targets, and tp with SP (every stage of a pipeline taking the positions: 4 processes).
        {"family": "llama", "packed": True},
        {"family": "llama", "packed": True, "tp": 2, "sp": True},
        # Tied embeddings under pp: the last stage's output copy gets the shared gradient and
        # stays equal to the embedding; saved at pp 2, resumed at pp 1.
        {"family": "llama-tied", "pp": 2, "schedule": "1f1b", "save": str(tied)},
        {"family": "llama-tied", "load": str(tied)},
        {"family": "llama-tied", "pp": 2, "schedule": "zbv"},  # one rank holds both ends
        {"family": "falcon40b-tied", "pp": 2, "schedule": "interleavedzb", "virtual_stages": 2},
        # Qwen 2 (q/k/v biases) and Qwen 3 (per-head q/k norms, k replicated under tp 2); under pp
        # with `make test-slow`.
        {"family": "qwen2", "tp": 2},
        {"family": "qwen3", "tp": 2, "sp": True},
        # Gemma 3: (1 + w) and sandwich norms as DTensor ops, local / global layers per stage.
        {"family": "gemma3", "tp": 2, "sp": True},
        {"family": "gemma3", "pp": 2, "schedule": "1f1b"},
        # LoRA: adapters on all seven projections over a frozen base; tp with SP (A or B split with
        # the linear), a pipeline, FSDP2 over dp and cp, saved at pp 2 (adapters and their moments
        # only) and resumed at dp 2.
        {"family": "llama", "lora": True, "tp": 2, "sp": True},
        {"family": "llama", "lora": True, "pp": 2, "schedule": "1f1b", "save": str(lora)},
        {"family": "llama", "lora": True, "load": str(lora)},
        {"family": "llama", "lora": True, "cp": 2},
        # QLoRA: the base's projections in NF4, FSDP2's shards of them NF4 shards of the codes one
        # process quantizes; a pipeline's stages each with their layers' (`QLORA`).
        {"family": "llama-nf4", "lora": "nf4"},
        {"family": "llama-nf4", "lora": "nf4", "pp": 2, "schedule": "1f1b"},
    ]


MORE_TWO = [
    # From make test's launch, to keep it under its budget:
    {"family": "mixtral", "ep": 2, "packed": True},
    {"family": "mixtral", "tp": 2, "sp": True, "microbatches": 2},
    {"family": "mixtral", "pp": 2, "schedule": "zbv", "recompute": "full"},
    {"family": "gpt-oss", "pp": 2, "schedule": "1f1b"},
    {"family": "deepseek", "ep": 2},
    {"family": "deepseek", "ep": 2, "recompute": "full"},
    {"family": "deepseek", "tp": 2, "sp": True, "recompute": "selective", "microbatches": 2},
    {"family": "deepseek", "lora": True, "tp": 2, "microbatches": 2},
    # GLM-4.5: partial rotary over tp's heads, cp's chunks and ep's experts.
    {"family": "glm4-moe", "ep": 2},
    {"family": "glm4-moe", "tp": 2, "sp": True, "microbatches": 2},
    {"family": "glm4-moe", "cp": 2},
    {"family": "glm4-moe", "lora": True, "tp": 2, "microbatches": 2},
    # Qwen 3.5 MoE: linear attention's heads, convolutions and decay over tp, packed documents
    # resetting its state through a pipeline, the experts over ep.
    {"family": "qwen3.5-moe", "ep": 2},
    {"family": "qwen3.5-moe", "tp": 2, "sp": True, "microbatches": 2},
    {"family": "qwen3.5-moe", "packed": True, "pp": 2, "schedule": "1f1b"},
    {"family": "qwen3.5-moe", "lora": True, "tp": 2, "microbatches": 2},
    {"family": "qwen2-moe", "ep": 2},
    {"family": "qwen2-moe", "tp": 2, "sp": True, "microbatches": 2},
    {"family": "qwen2-moe", "ep": 2, "recompute": "full"},
    {"family": "qwen2-moe", "lora": True, "tp": 2, "microbatches": 2},  # the shared experts adapted
    {"family": "llama", "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "falcon40b", "tp": 2, "sp": True},
    {"family": "llama", "packed": True, "pp": 2, "schedule": "zbv"},
    {"family": "qwen2", "pp": 2, "schedule": "1f1b"},
    {"family": "qwen3", "pp": 2, "schedule": "1f1b"},
    {"family": "llama", "tp": 2},
    {"family": "llama", "pp": 2, "schedule": "gpipe"},
    {"family": "llama", "pp": 2, "schedule": "interleavedzb", "virtual_stages": 2},
    {"family": "llama", "pp": 2, "schedule": "1f1b", "microbatches": 4},  # steady 1F1B phase
    {"family": "llama", "dp_mode": "replicate"},
    # bf16 compute copies as DTensors under TP, and zbv's fallback to FSDP2.
    {"family": "llama", "tp": 2, "sp": True, "precision": "bf16"},
    {"family": "llama", "pp": 2, "schedule": "zbv", "precision": "bf16"},
    {"family": "falcon", "tp": 2},
    {"family": "falcon"},
    {"family": "falcon40b", "tp": 2},
    {"family": "mistral", "tp": 2, "sp": True},
    {"family": "mistral"},
    {"family": "llama", "packed": True, "pp": 2, "schedule": "1f1b"},
    {"family": "mistral", "packed": True, "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "llama-tied", "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "llama-tied", "pp": 2, "schedule": "1f1b", "precision": "bf16"},
    {"family": "falcon40b-tied", "pp": 2, "schedule": "1f1b"},
    {"family": "falcon40b-tied", "pp": 2, "schedule": "zbv"},
    {"family": "qwen2", "tp": 2, "sp": True},
    {"family": "qwen3", "tp": 2},
    {"family": "gemma3", "tp": 2},
    {"family": "mistral", "cp": 2},
    {"family": "gemma3", "cp": 2},
    {"family": "falcon", "cp": 2},
    {"family": "qwen3", "cp": 2, "precision": "bf16"},  # bf16 through FSDP2 over cp alone
    {"family": "llama", "cp": 2, "recompute": "selective"},  # the gathers run again in backward
    {"family": "mistral", "cp": 2, "recompute": "full"},
    {"family": "llama", "lora": True, "pp": 2, "schedule": "zbv"},
    {"family": "llama", "lora": True, "packed": True, "tp": 2, "recompute": "full"},
    {"family": "llama", "lora": True, "precision": "bf16"},
    {"family": "llama-nf4", "lora": "nf4", "precision": "bf16"},
    {"family": "mixtral", "lora": True, "ep": 2},  # every attention projection adapted
    # Compute copies beside NF4 weights, which keep none.
    {"family": "llama-nf4", "lora": "nf4", "pp": 2, "schedule": "1f1b", "precision": "bf16"},
]


def four_process_core(ckpt: Path, tp_dp: Path, cp_dp: Path) -> list[dict]:
    return [
        {"family": "llama", "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b", "save": str(ckpt)},
        {"family": "llama", "tp": 2, "sp": True, "load": str(ckpt)},
        # tp x dp: FSDP2 shards the tp-replicated norms over dp alone; one tp rank writes them.
        {"family": "llama", "tp": 2, "save": str(tp_dp)},
        # Context parallel: dp x cp with packed documents and ignored targets, saved at cp 2 and
        # resumed at cp 1 (cp 4, with tp and SP, a pipeline and Mistral's window: `make test-slow`).
        {"family": "llama", "cp": 2, "packed": True, "save": str(cp_dp)},
        {"family": "llama", "packed": True, "tp": 2, "load": str(cp_dp)},
    ]


MORE_FOUR = [
    # From make test's launch, to keep it under 15 minutes (2026-12-07): kv heads replicated over
    # tp 4, a token per chunk at cp 4, LoRA over tp x pp with sequence parallel, Qwen 2 MoE's
    # shared expert split over tp beside ep.
    {"family": "llama-gqa8", "tp": 4},  # 2 kv heads replicated, 2 query heads per rank
    {"family": "llama", "cp": 4},
    {"family": "llama", "lora": True, "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"},
    {"family": "qwen2-moe", "ep": 2, "tp": 2, "sp": True},  # the shared expert split over tp
    # From make test's launch, to keep it under its budget (DeepSeek V3's latent attention over tp
    # and its routing over ep stay there apart: moe_two's tp 2, moe_four's ep 2 x cp 2).
    # DeepSeek V3: latent attention's heads over tp (its shared rotated k's gradient summed over
    # them), grouped sigmoid routing over ep, the balancing bias moved each step.
    {"family": "deepseek", "ep": 2, "tp": 2, "sp": True},
    {"family": "llama", "packed": True, "tp": 2, "pp": 2, "sp": True, "schedule": "zbv"},
    # Tied embeddings: the shared gradient summed over each (tp, dp) pair of end ranks.
    {"family": "llama-tied", "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"},
    {"family": "llama", "cp": 2, "tp": 2, "sp": True},
    {"family": "llama-tied", "cp": 2, "pp": 2, "schedule": "zbv"},
    {"family": "mistral", "cp": 2, "tp": 2},
    {"family": "mixtral", "ep": 2, "tp": 2, "sp": True, "packed": True},
    {"family": "mixtral4", "ep": 2, "pp": 2, "schedule": "1f1b"},
    {"family": "llama-tied", "pp": 2, "schedule": "1f1b", "packed": True},  # pp2 x dp2, FSDP2
    {"family": "falcon40b-tied", "tp": 2, "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "gemma3", "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"},
    {"family": "qwen3", "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"},
    {"family": "llama", "tp": 2, "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "falcon", "tp": 2, "sp": True},
    {"family": "falcon40b", "tp": 4, "sp": True},
    {"family": "mistral", "tp": 2, "pp": 2, "schedule": "gpipe"},
    {"family": "mistral", "tp": 2, "sp": True},
    {"family": "llama", "packed": True, "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"},
    {"family": "llama", "packed": True, "pp": 2, "schedule": "gpipe"},  # pp2 x dp2
    {"family": "falcon40b-tied", "tp": 2, "pp": 2, "sp": True, "schedule": "zbv"},
    {"family": "qwen2", "tp": 2, "pp": 2, "schedule": "1f1b"},
    {"family": "qwen3", "tp": 2},  # tp2 x dp2: FSDP2 over the q/k norms' summed gradients
    {"family": "mistral", "cp": 2, "packed": True, "pp": 2, "schedule": "1f1b"},
    {"family": "gemma3", "cp": 2, "tp": 2, "sp": True},
    {"family": "llama", "cp": 4, "packed": True},
    {"family": "llama", "cp": 2, "pp": 2, "schedule": "gpipe"},
    {"family": "qwen2", "cp": 2, "pp": 2, "schedule": "1f1b"},  # tied: the pair group spans cp
    {"family": "falcon40b-tied", "cp": 2, "pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "mixtral4", "ep": 2},  # ep 2 within dp 4: FSDP2 over the other 2 for the experts
    {"family": "mixtral4", "ep": 2, "pp": 2, "schedule": "zbv"},
    {"family": "mixtral", "tp": 2, "pp": 2, "sp": True, "schedule": "interleaved1f1b", "virtual_stages": 2},
    {"family": "mixtral", "ep": 2, "tp": 2, "recompute": "full"},
    {"family": "mixtral-collapsed", "ep": 2, "tp": 2},  # one ep rank's experts get every row
    {"family": "qwen2-moe", "tp": 2, "pp": 2, "sp": True, "schedule": "zbv"},
    {"family": "deepseek", "tp": 2, "pp": 2, "sp": True, "schedule": "zbv"},
    {"family": "deepseek", "cp": 2, "tp": 2, "sp": True},
    {"family": "deepseek", "cp": 2, "pp": 2, "schedule": "1f1b"},
    {"family": "gpt-oss", "ep": 2, "cp": 2},  # sinks under cp, the experts' biases over edp x cp
]


def assert_reshards_bit_exactly(ckpt: Path, out: Path, tp: int, pp: int) -> None:
    """mega-shard's reshard of a live run's checkpoint into tp x pp holds every tensor (weights and
    AdamW moments) bit for bit."""
    reshard(ckpt, out, tp, pp, log=lambda msg: None)
    saved, resharded = open_artifact(ckpt, "checkpoint"), open_artifact(out, "checkpoint")
    with TensorReader(ckpt) as a, TensorReader(out) as b:
        for name, entry in saved.tensors.items():
            assert_bitwise_equal(a.read(name, entry), b.read(name, resharded.tensors[name]), name)


def moe_two(dp2: Path, ep2: Path) -> list[dict]:
    return [
        {"family": "mixtral", "save": str(dp2)},
        {"family": "mixtral", "pp": 2, "schedule": "1f1b", "load": str(dp2)},
        {"family": "mixtral", "ep": 2, "save": str(ep2)},
        {"family": "mixtral", "load": str(ep2)},  # ep 2 -> ep 1 (dp 2)
        {"family": "qwen2-moe", "pp": 2, "schedule": "1f1b"},  # a dense and a sparse layer a stage
        {"family": "deepseek", "pp": 2, "schedule": "1f1b"},
        {"family": "deepseek", "tp": 2, "microbatches": 2},
        {"family": "deepseek", "cp": 2},  # the router's z-loss a mean over each rank's part of a row
        # gpt-oss: sinks per head under tp and cp (each chunk's suffix attention with them), the
        # experts' biases over ep and tp.
        {"family": "gpt-oss", "tp": 2, "microbatches": 2},
        {"family": "gpt-oss", "ep": 2},
        {"family": "gpt-oss", "cp": 2},
        {"family": "mixtral-collapsed", "ep": 2},  # one rank's experts get every row, the other's none
        # The attention and the router (`gate`) adapted, the experts frozen, at ep 2.
        {"family": "mixtral", "lora": "router", "ep": 2},
    ]


def moe_four(ep2tp2: Path, oss: Path, ep2cp2: Path) -> list[dict]:
    return [
        {"family": "mixtral4", "ep": 4},
        # ep 2 x cp 2: the experts sharded by FSDP2 over edp x cp (ranks apart in the mesh), the
        # balancing bias moved from the loads of every rank's part of the rows.
        {"family": "deepseek", "ep": 2, "cp": 2, "save": str(ep2cp2)},
        {"family": "deepseek", "load": str(ep2cp2)},  # ep 2 x cp 2 -> dp 4
        {"family": "mixtral", "ep": 2, "tp": 2, "save": str(ep2tp2)},
        {"family": "gpt-oss", "ep": 2, "tp": 2, "save": str(oss)},
        {"family": "mixtral", "tp": 2, "pp": 2, "load": str(ep2tp2)},
    ]


# One launch per process count (a launch's start-up is seconds); the tests read its checkpoints.
@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two")
    launch(out, 2, two_process_core(out / "ckpt-dp2", out / "ckpt-tied-pp2", out / "ckpt-lora-pp2")
           + moe_two(out / "ckpt-moe-dp2", out / "ckpt-moe-ep2"))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("four")
    launch(out, 4, four_process_core(out / "ckpt-tp2pp2", out / "ckpt-tp2-dp2", out / "ckpt-cp2-dp2")
           + moe_four(out / "ckpt-ep2tp2", out / "ckpt-gpt-oss-ep2tp2", out / "ckpt-deepseek-ep2cp2"))  # fmt: skip
    return out


@pytest.mark.dist
def test_two_processes_tp_pp_dp_match_one_process(tmp_path: Path, two_processes: Path) -> None:
    ckpt, tied = two_processes / "ckpt-dp2", two_processes / "ckpt-tied-pp2"
    # A tied checkpoint holds the embedding once, whatever layout saved it.
    assert "lm_head.weight" not in open_artifact(tied, "checkpoint").tensors
    # The live checkpoint (FSDP-sharded weights and AdamW moments) reshards like any other.
    saved = open_artifact(ckpt, "checkpoint")
    assert saved.layout.dp == 2 and saved.training is not None and saved.training.step == 3
    assert len(saved.tensors["layers.0.mlp.up_proj.weight"].pieces) == 2
    assert "optim.exp_avg_sq.layers.3.attn.k_proj.weight" in saved.tensors
    assert_reshards_bit_exactly(ckpt, tmp_path / "tp2pp2", 2, 2)


@pytest.mark.dist
def test_lora_matches_one_process(tmp_path: Path, two_processes: Path) -> None:
    """The LoRA scenarios of the 2-process launch passed (`two_process_core`); the pp 2 checkpoint
    holds the adapters and their AdamW moments and nothing of the frozen base, each adapter in
    its layer's stage, and mega-shard takes it to tp 2 (B split on the rows of q/k/v/gate/up, A on
    the columns of o/down) bit-exactly."""
    saved = open_artifact(two_processes / "ckpt-lora-pp2", "checkpoint")
    assert saved.adapter is not None and saved.adapter.rank == 4
    names = set(saved.tensors)
    assert len(names) == 4 * 7 * 2 * 3  # layers x projections x (A, B) x (weight, two moments)
    assert "layers.3.mlp.down_proj.lora_B.weight" in names and "embed.weight" not in names
    assert "optim.exp_avg.layers.0.attn.q_proj.lora_A.weight" in names
    files = {p.file for p in saved.tensors["layers.3.attn.q_proj.lora_A.weight"].pieces}
    assert files == {"model-pp01-tp00.safetensors"}
    assert_reshards_bit_exactly(two_processes / "ckpt-lora-pp2", tmp_path / "tp2", 2, 1)
    tp2 = open_artifact(tmp_path / "tp2", "checkpoint")
    assert [p.shape for p in tp2.tensors["layers.0.attn.q_proj.lora_B.weight"].pieces] == [[16, 4], [16, 4]]
    assert [p.shape for p in tp2.tensors["layers.0.attn.o_proj.lora_A.weight"].pieces] == [[4, 16], [4, 16]]
    assert [p.shape for p in tp2.tensors["layers.0.attn.q_proj.lora_A.weight"].pieces] == [[4, 32]]


@pytest.mark.dist
def test_mixture_of_experts_matches_one_process(tmp_path: Path, two_processes: Path) -> None:
    """Mixtral (router losses on) under FSDP2 over dp 2, saved and resumed at pp 2; expert parallel
    ep 2 (packed documents too; a router sending every token to one rank's experts), saved and
    resumed at ep 1; the experts split over tp 2 with sequence parallel; pipelined with full
    recompute (each layer's statistics counted once): `moe_two`, in the 2-process launch. The ep 2
    checkpoint reshards to one file bit-exactly."""
    dp2, ep2 = two_processes / "ckpt-moe-dp2", two_processes / "ckpt-moe-ep2"
    assert len(open_artifact(dp2, "checkpoint").tensors["layers.0.mlp.experts.gate_proj.weight"].pieces) == 2
    saved = open_artifact(ep2, "checkpoint")
    experts = saved.tensors["layers.0.mlp.experts.gate_proj.weight"].pieces
    assert sorted(p.offset[0] for p in experts) == [0, 2]  # each ep rank's two experts
    assert_reshards_bit_exactly(ep2, tmp_path / "one", 1, 1)


@pytest.mark.dist
def test_expert_parallel_on_four_processes_matches_one_process(tmp_path: Path, four_processes: Path) -> None:
    """ep 4 (one expert per rank); ep 2 x tp 2 (each expert's ffn split over tp), saved and resumed
    at tp 2 x pp 2 (ep 1) (`moe_four`, in the 4-process launch; with sequence parallel and packed
    documents, and ep 2 x pp 2: `make test-slow`); ep 2 x cp 2 (DeepSeek V3; gpt-oss: `make
    test-slow`). The ep 2 x tp 2 checkpoint's pieces are each rank's experts and ffn slice; mega-shard
    takes it to one file and back bit-exactly."""
    ep2tp2 = four_processes / "ckpt-ep2tp2"
    gate = open_artifact(ep2tp2, "checkpoint").tensors["layers.0.mlp.experts.gate_proj.weight"]
    assert gate.shape == [4, 48, 32]
    assert sorted((p.offset, p.shape) for p in gate.pieces) == [
        ([2 * e, 24 * t, 0], [2, 24, 32]) for e in range(2) for t in range(2)
    ]
    assert_reshards_bit_exactly(ep2tp2, tmp_path / "one", 1, 1)
    # gpt-oss's experts' biases: gate/up's pieces each rank's experts and ffn slice, down's its
    # experts only (stored once over tp)
    oss = open_artifact(four_processes / "ckpt-gpt-oss-ep2tp2", "checkpoint").tensors
    up, down = oss["layers.0.mlp.experts.up_proj.bias"], oss["layers.0.mlp.experts.down_proj.bias"]
    assert sorted((p.offset, p.shape) for p in up.pieces) == [
        ([2 * e, 12 * t], [2, 12]) for e in (0, 1) for t in (0, 1)
    ]
    assert sorted((p.offset, p.shape) for p in down.pieces) == [([0, 0], [2, 32]), ([2, 0], [2, 32])]
    assert_reshards_bit_exactly(four_processes / "ckpt-gpt-oss-ep2tp2", tmp_path / "oss", 1, 1)
    # ep 2 x cp 2: an experts tensor's pieces are each ep rank's experts, their rows split over cp
    # (edp 1); mega-shard takes the checkpoint to one file bit-exactly.
    ds = four_processes / "ckpt-deepseek-ep2cp2"
    gate = open_artifact(ds, "checkpoint").tensors["layers.1.mlp.experts.gate_proj.weight"]
    rows = gate.shape[1] // 2
    assert sorted((p.offset, p.shape) for p in gate.pieces) == [
        ([2 * e, rows * c, 0], [2, rows, gate.shape[2]]) for e in range(2) for c in range(2)
    ]
    assert_reshards_bit_exactly(ds, tmp_path / "ds", 1, 1)
    reshard(tmp_path / "one", tmp_path / "back", 2, 1, ep=2, log=lambda msg: None)
    with TensorReader(ep2tp2) as a, TensorReader(tmp_path / "back") as b:
        back = open_artifact(tmp_path / "back", "checkpoint")
        for name, entry in open_artifact(ep2tp2, "checkpoint").tensors.items():
            assert_bitwise_equal(a.read(name, entry), b.read(name, back.tensors[name]), name)
            if "experts" in name:  # the same pieces as the run wrote
                assert sorted(p.offset for p in back.tensors[name].pieces) == sorted(
                    p.offset for p in entry.pieces
                )


@pytest.mark.dist
def test_four_processes_2d_layouts_match_one_process(tmp_path: Path, four_processes: Path) -> None:
    tp_dp, cp_dp = four_processes / "ckpt-tp2-dp2", four_processes / "ckpt-cp2-dp2"
    # The weights of a cp run: sharded over dp x cp like over dp alone.
    assert len(open_artifact(cp_dp, "checkpoint").tensors["layers.0.mlp.up_proj.weight"].pieces) == 4
    saved = open_artifact(tp_dp, "checkpoint")
    assert (saved.layout.tp, saved.layout.dp) == (2, 2)
    assert_reshards_bit_exactly(tp_dp, tmp_path / "tp1", 1, 1)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("nproc", "scenarios"), [(2, MORE_TWO), (4, MORE_FOUR)], ids=["2", "4"])
def test_more_layouts_match_one_process(tmp_path: Path, nproc: int, scenarios: list[dict]) -> None:
    launch(tmp_path, nproc, scenarios)


@pytest.mark.slow  # 29 s; in make test: test_model_parity.py's compiled blocks against transformers
@pytest.mark.dist
def test_compiled_blocks_match_one_process(tmp_path: Path) -> None:
    """torch.compile per block under TP + SP (graphs over DTensors), under FSDP2 (compiled before
    sharding, its hooks outside the graphs) and in a pipeline stage: same numbers as one eager process."""
    launch(
        tmp_path,
        2,
        [
            {"family": "llama", "tp": 2, "sp": True, "compile": True},
            {"family": "llama", "compile": True},
            {"family": "mistral", "pp": 2, "schedule": "1f1b", "compile": True},
        ],
    )
