"""The memory planner (`megacore.planner`) against live runs, and `mega-train --dry-run --gpus N
--gpu-memory 80GB`'s command line: its state bytes are the tensors a live run holds on every rank
(each scenario's figures under torchrun, held against planned to the byte), its activation
estimate is within 25% of a measured step, never over its peak (cp 2: 3% under to 10% over the
tensors autograd saves), the plan needs no torch and plans a model from its config.json, and its
command line follows the tools' conventions. The activations' closed forms:
test_planner_activations.py; the pages' tables: test_planner_tables.py; the shapes they share:
tests/planner_cases.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from helpers import assert_one_line_error, dry_run_without_torch, run_in_process, torchrun_script
from megacore import planner
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.config_parts import LatentAttentionSpec, MoESpec
from megacore.errors import UserError
from megacore.parallel.layout import Parallelism
from megacore.planner import GiB
from planner_cases import GLOBAL_BATCH, SHAPES, B, S, dry_run
from runlib import write_run

WORKER = Path(__file__).with_name("planner_worker.py")


# A measured scenario (cp 2, "measure"): its activations and peak, planned against measured. Both
# ratios measured 30 times for each rank of CP_MEASURED and MLA_CP_MEASURED (2026-12-07, 2 ranks):
# - activations / the bytes of the tensors autograd saves: 1.088 and 1.086 (Llama, ranks 0 and 1),
#   0.993 and 0.991 (latent attention), the same in every run (storages, not timing). The bound
#   leaves 2% under the lowest, 1% over the highest: an estimate under what is saved is a plan
#   that runs out of memory; one more than 10% over wastes the GPUs the layout search hands out.
# - (activations + buffers) / the step's peak: 1.015 to 1.236, varying with when gloo's
#   all-gathers free their buffers (the buffers are counted at once, so the sum overshoots). The
#   bound leaves 11% under the lowest, half the spread's width (at most 10% short of the peak, the
#   planner's stated accuracy: planner/memory.py), and 5% over the highest.
SAVED_BOUNDS = (0.97, 1.10)
PEAK_BOUNDS = (0.90, 1.30)


def scenario_problems(scenario: dict, figures: dict) -> list[str]:
    """What is wrong with one rank's figures for a scenario (planner_worker.py's `run`): the bytes
    it held after a step against the planner's `rank_state` (to the byte), the rows of `estimate`
    that list it (exactly one, with those bytes), and a measured step's ratios (the bounds above)."""
    held, planned = figures["held"], figures["planned"]
    problems = []
    if held != planned:
        off = {k: (held[k], planned[k]) for k in held if held[k] != planned[k]}
        problems.append(f"held != planned (held, planned): {off}")
    if figures["listed"] != [held]:
        problems.append(f"estimate lists the rank as {figures['listed']}, not once as held {held}")
    measured = figures.get("measured")
    if bool(scenario.get("measure")) != (measured is not None):
        problems.append(f"measured figures {measured} for a scenario with measure={scenario.get('measure')}")
    if measured:
        act, saved = measured["activations"], measured["saved"]
        planned_peak, peak = act + measured["buffers"], measured["peak"]
        if not SAVED_BOUNDS[0] <= act / saved <= SAVED_BOUNDS[1]:
            problems.append(f"activations {act} / saved {saved} = {act / saved:.3f}, not in {SAVED_BOUNDS}")
        if not PEAK_BOUNDS[0] <= planned_peak / peak <= PEAK_BOUNDS[1]:
            problems.append(
                f"activations + buffers {planned_peak} / peak {peak} = {planned_peak / peak:.3f}, "
                f"not in {PEAK_BOUNDS}"
            )
    return problems


def launch(tmp_path: Path, nproc: int, scenarios: list[dict]) -> None:
    """Runs the scenarios under torchrun (planner_worker.py, one `RESULT` line of figures per
    scenario) and holds every scenario on every rank to `scenario_problems`: each one reported, in
    order, by each rank, and none with a problem (all of them named, with their figures, if any)."""
    spec = tmp_path / f"scenarios-{nproc}.json"
    spec.write_text(json.dumps(scenarios))
    proc = torchrun_script(nproc, WORKER, spec, timeout=600)
    results = [
        json.loads(line.removeprefix("RESULT "))
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert [r["scenario"] for r in results] == scenarios, proc.stdout
    problems = []
    for result in results:
        name = json.dumps(result["scenario"])
        assert [f["rank"] for f in result["ranks"]] == list(range(nproc)), (name, result["ranks"])
        problems += [
            f"{name} rank {f['rank']}: {p}"
            for f in result["ranks"]
            for p in scenario_problems(result["scenario"], f)
        ]
    assert not problems, "\n".join(problems)


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
               "num_heads": 8, "num_kv_heads": 8, "head_dim": 48, "ffn_hidden_size": 688, "max_seq_len": 512,
               "attention": {"type": "latent", "q_lora_rank": 96, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                             "v_head_dim": 32}},
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
MOE = {"family": "mixtral", "mlp": {"type": "moe", "num_experts": 2, "experts_per_token": 1}}


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
    import gc
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile

    # Python's collector frees earlier steps' cyclic garbage whenever earlier allocations (other
    # tests' too) make it run: done before the step and held off during it, so the events are the
    # step's alone (a make test run once counted an MoE step's kept statistics 0 and 3 times).
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            pm.forward_backward(tokens, targets)
    finally:
        gc.enable()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    # The step's own thread (backward on a CPU runs on the caller's): its thousands of events. Another
    # thread an earlier test left (a writer, a logger) frees its own tensors in the window too (a
    # clean-clone make test counted 80 bytes kept of 96: 16 freed elsewhere).
    (step_thread, _), *others = Counter(e.start_thread_id() for e in events).most_common()
    live = peak = 0
    for e in sorted((e for e in events if e.start_thread_id() == step_thread), key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    # The step left nothing behind but `kept` bytes (an MoE layer's statistics of the step).
    assert live == kept and torch.is_tensor(pm.parameters().__next__().grad), (live, kept, others)
    return peak


# Mixtral's shape at the same size: 4 experts of a quarter of the dense ffn each, top-2.
MOE_ACT_CONFIG = msgspec.structs.replace(
    ACT_CONFIG, family="mixtral", ffn_hidden_size=172, mlp=MoESpec(num_experts=4, experts_per_token=2)
)

# DeepSeek V3's latent attention at the same size (its MLP dense): q and k heads of 48, v of 32.
MLA_ACT_CONFIG = msgspec.structs.replace(
    ACT_CONFIG, family="deepseek_v3", num_kv_heads=8, head_dim=48,
    attention=LatentAttentionSpec(q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32),
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
        stats = 0 if config.moe is None else config.num_layers * (config.moe.num_experts + 2) * 4
        peak = measured_peak(pm, rows[:, :-1], rows[:, 1:], kept=stats)
    finally:
        shutdown()
    estimate = planner.rank_activations(config, par, 0, MICRO, SEQ)
    # The estimate counts the tensors the step saves (byte for byte for the dense models here,
    # within 1% for a mixture of experts'), the peak holds those and the working buffers of the
    # moment (the fused loss's chunk, the experts' dispatch) that the planner counts apart
    # (`rank_buffers`): an estimate over the peak counts bytes the step never holds. Measured
    # (2026-12-07, a CPU with AVX512-BF16; the same in every run), estimate / peak: fp32 0.958-0.973
    # (Llama, latent attention, Mixtral); bf16 0.906 (Mixtral), 0.922-0.957 (Llama, latent
    # attention). Under it by at most 15% in fp32 and 25% in bf16, whose kernels' scratch (in the
    # peak) differs by CPU.
    under = 0.15 if precision == "fp32" else 0.25
    assert (1 - under) * peak <= estimate <= peak, (estimate, peak, estimate / peak)


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
