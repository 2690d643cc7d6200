"""mega-train end to end, as users run it: real processes (torchrun on gloo for the parallel ones), a
real tokens artifact, checkpoints read back through the checkpoint module and the other tools.

The reference is one process, fp32, micro batch 2 (accumulation 4). Parallel layouts must reach its
loss at every step within LOSS_REL (fp32; reductions run in another order); a resumed run in the same
layout must end bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import BIN, assert_one_line_error, load_decoder, run_tool
from mega_train.launch import children
from megacore.artifacts import open_artifact
from megacore.checkpoint import CheckpointReader
from runlib import (
    TINY_LLAMA,
    assert_losses_close,
    free_port,
    losses,
    metrics,
    ok,
    torchrun,
    train,
    write_run,
)


def test_one_process_trains_and_writes_everything(reference: Path) -> None:
    train_rows, eval_rows = metrics(reference), metrics(reference, "eval")
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.3, losses(reference)
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in train_rows)
    # warmup over 2 steps, then cosine from 3e-3 to min_lr 3e-4 at step 12
    assert [r["lr"] for r in train_rows[:3]] == pytest.approx([1.5e-3, 3e-3, 3e-3])
    assert train_rows[-1]["lr"] > 3e-4 and train_rows[-1]["lr"] < train_rows[2]["lr"]
    assert [r["step"] for r in eval_rows] == [6, 12]
    assert eval_rows[1]["loss"] < eval_rows[0]["loss"] and eval_rows[1]["ppl"] > 1
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "latest",
        "step-00000004",
        "step-00000008",
        "step-00000012",
    ]
    assert os.readlink(ckpts / "latest") == "step-00000012"
    with CheckpointReader(ckpts / "latest") as ckpt:
        t = ckpt.manifest.training
        assert (t.step, t.optimizer_steps, t.consumed_samples) == (12, 12, 96)
        assert t.rng_files == ["rank-state/rank-00000.safetensors"]
        assert "optim.exp_avg.layers.0.attn.q_proj.weight" in ckpt.manifest.tensors
        # vocab padding rows (400..511) of the embedding and output projection stay exactly zero
        for name in ("embed.weight", "lm_head.weight", "optim.exp_avg.embed.weight"):
            assert not ckpt.read(name)[TINY_LLAMA["vocab_size"] :].any(), name


@pytest.mark.slow  # 35 s; in make test: test_instruct.py's tp2 x pp2 (zbv) and test_context.py's cp2 x tp2 runs against one process
def test_parallel_layouts_match_one_process(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """tp2 x pp2 (4 processes, micro batch 1) from fresh seeded weights: the loss at every step
    (and the eval loss) within LOSS_REL of one process with micro batch 2."""
    want = losses(reference)
    tp_pp = write_run(tmp_path / "tp2pp2", tokens, parallel={"tp": 2, "pp": 2}, batch={"micro_batch_size": 1})
    out = ok(torchrun(4, tp_pp))
    assert "world 4 = tp 2 x pp 2 x dp 1; batch 8 = micro 1 x dp 1 x accum 8" in out.stdout
    assert out.stdout.count("step 12/12") == 1  # rank 0 alone reports
    assert_losses_close(losses(tp_pp.parent / "run"), want)
    want_eval = [r["loss"] for r in metrics(reference, "eval")]
    assert_losses_close([r["loss"] for r in metrics(tp_pp.parent / "run", "eval")], want_eval)


@pytest.mark.slow  # 15 s; in make test: test_multinode.py's tp2 x dp2 (FSDP2) against one process
def test_data_parallel_matches_one_process_and_exports(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """dp2 with FSDP2 (micro batch 4) from fresh seeded weights: the loss at every step within
    LOSS_REL of one process, and its final checkpoint exported and verified as it is."""
    want = losses(reference)
    dp = write_run(tmp_path / "dp2", tokens, batch={"micro_batch_size": 4})
    ok(torchrun(2, dp))
    assert_losses_close(losses(dp.parent / "run"), want)
    # The final checkpoint is an artifact the other tools take as it is (dp2 has -dp pieces; the
    # README tour's test exports and verifies a tp 2 x pp 2 one).
    final = dp.parent / "run" / "checkpoints" / "latest"
    run_tool("mega-export", final, dp.parent / "hf", check=True)
    run_tool("mega-convert", "verify", final, dp.parent / "hf", check=True)


@pytest.mark.slow  # 20 s; in make test: test_tied_pp.py resumes pp 2 at pp 1, the equivalence tests load across layouts
def test_resume_in_another_layout(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """Checkpointed at tp1 (step 4 of the reference), resumed at tp2 x pp2: steps 5..12 match."""
    run_json = write_run(tmp_path, tokens, parallel={"tp": 2, "pp": 2}, batch={"micro_batch_size": 1})
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("step-00000008", "step-00000012", "latest"))
    proc = ok(torchrun(4, run_json))
    assert f"resuming from {out / 'checkpoints' / 'step-00000004'} (step 4 of 12)" in proc.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, 13))
    assert_losses_close(losses(out), losses(reference))


@pytest.mark.slow  # 12 s; in make test: test_lifecycle.py stops the launcher and plain torchrun by signal
def test_sigterm_saves_and_exits_zero(tmp_path: Path, tokens: Path) -> None:
    """SIGTERM (as SLURM sends before preemption) in one process and to every worker under torchrun:
    a checkpoint at the next step boundary, exit 0, and the rerun resumes from it."""
    long = {"train_steps": 100000, "checkpoint": {"every": 100000}}
    single = write_run(tmp_path / "single", tokens, **long)
    dp2 = write_run(tmp_path / "dp2", tokens, batch={"micro_batch_size": 4}, **long)
    for run_json, nproc in ((single, 1), (dp2, 2)):
        out = run_json.parent / "run"
        cmd = [str(BIN / "mega-train"), "--manifest", str(run_json)]
        if nproc > 1:
            cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()), *cmd]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3):
            time.sleep(0.05)
        for pid in [proc.pid] if nproc == 1 else children(proc.pid):
            os.kill(pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, (nproc, stdout[-2000:], stderr[-3000:])
        saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
        assert len(saved) == 1, saved
        step = int(saved[0].removeprefix("step-"))
        assert f"SIGTERM at step {step}: checkpoint saved" in stdout
        assert metrics(out)[-1]["step"] == step
        with CheckpointReader(out / "checkpoints" / saved[0]) as ckpt:
            assert ckpt.manifest.training.step == step


@pytest.mark.slow
def test_json_summary_names_the_newest_checkpoint(tmp_path: Path, tokens: Path) -> None:
    """--json under torchrun: stdout is one JSON object (rank 0's; the console lines went to stderr)
    naming the newest checkpoint and the last losses as metrics.jsonl has them; a rerun of the
    finished run says the same without training. (Slow: `make test` keeps a launched run's --json
    in tests/train/test_harness.py.)"""
    run_json = write_run(tmp_path, tokens, train_steps=4, eval={"every": 2, "iters": 1})
    out = tmp_path / "run"
    first = ok(torchrun(2, run_json, "--json"))
    summary = json.loads(first.stdout)
    newest = out / "checkpoints" / "step-00000004"
    assert summary["out"] == str(newest) and summary["kind"] == "checkpoint"
    assert summary["manifest_sha256"] == hashlib.sha256((newest / "manifest.json").read_bytes()).hexdigest()
    assert (summary["step"], summary["train_steps"], summary["complete"], summary["stopped_by"]) == (
        4,
        4,
        True,
        None,
    )
    assert summary["train_loss"] == metrics(out)[-1]["loss"]
    assert summary["valid_loss"] == metrics(out, "eval")[-1]["loss"]
    assert summary["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 1}
    assert "step 4/4" in first.stderr and "saved" in first.stderr
    again = ok(torchrun(2, run_json, "--json"))
    assert json.loads(again.stdout) == summary
    assert "already complete" in again.stderr and "step 4/4" not in again.stderr


def test_nan_policies(tmp_path: Path, tokens: Path, reference: Path) -> None:
    """A poisoned gradient (step 3) and a poisoned loss (step 6) are never applied: `skip` counts them
    and goes on; `halt` stops at the second (exit 1, one line), leaving the step-4 checkpoint intact."""
    inject = {"MEGA_TRAIN_INJECT": "nan-grad@3,nan-loss@6"}
    # Checkpoints in a directory of the user's choice, keeping the last 2; a directory there that
    # is not a checkpoint of this run is never touched.
    skip = write_run(tmp_path / "skip", tokens, checkpoint={"every": 4, "keep": 2, "dir": "ckpts"})
    notes = tmp_path / "skip" / "ckpts" / "step-00000002"
    notes.mkdir(parents=True)
    (notes / "notes.txt").write_text("mine")
    ok(train(skip, env=inject))
    rows = metrics(skip.parent / "run")
    kept = sorted(p.name for p in (skip.parent / "ckpts").iterdir())
    assert kept == ["latest", "step-00000002", "step-00000008", "step-00000012"]
    assert (notes / "notes.txt").read_text() == "mine"
    assert [(r["skipped"], r["nan_steps"]) for r in rows][1:7] == [
        (0, 0),
        (1, 1),
        (1, 1),
        (1, 1),
        (2, 2),
        (2, 2),
    ]
    assert rows[2]["grad_norm"] is None and rows[5]["loss"] is None
    # Steps 1-2 equal the reference; step 3's update was skipped, so step 4 differs from it.
    assert losses(skip.parent / "run")[:3] == losses(reference)[:3]
    with CheckpointReader(skip.parent / "ckpts" / "latest") as ckpt:
        t = ckpt.manifest.training
        assert (t.step, t.optimizer_steps, t.counters["skipped"], t.counters["nan_steps"]) == (12, 10, 2, 2)

    halt = write_run(tmp_path / "halt", tokens, nan={"policy": "halt", "max_steps": 2})
    proc = train(halt, env=inject)
    out = halt.parent / "run"
    assert_one_line_error(proc, "step 6: loss or gradients not finite (2 such steps", "step-00000004", code=1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000004"]
    open_artifact(out / "checkpoints" / "step-00000004", "checkpoint", verify="sha256")
    load_decoder(out / "checkpoints" / "step-00000004")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precisions_train(tmp_path: Path, tokens: Path, precision: str) -> None:
    """bf16 and fp16 compute (fp32 master weights) lower the loss; fp16 starting at a loss scale that
    overflows skips those steps, halving the scale each time, and then trains."""
    opt = {"initial_loss_scale": 2.0**20} if precision == "fp16" else {}
    run_json = write_run(tmp_path, tokens, precision=precision, train_steps=20, optimizer=opt)
    ok(train(run_json))
    rows = metrics(tmp_path / "run")
    applied = [r for r in rows if r["grad_norm"] is not None]
    assert applied[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]
    if precision == "fp16":
        skipped = rows[-1]["skipped"]
        assert skipped >= 1 and rows[-1]["nan_steps"] == 0
        assert rows[-1]["loss_scale"] == 2.0 ** (20 - skipped)
    else:
        assert rows[-1]["skipped"] == 0 and rows[-1]["loss_scale"] is None


@pytest.mark.slow  # 40 s of two measured runs; the planner's activation test covers recompute's bytes
def test_full_recompute_lowers_peak_memory(tmp_path: Path, tokens: Path) -> None:
    """Long sequences, few parameters: activations dominate. Full recompute keeps only each block's
    input for backward: a lower peak resident set, and the same losses (fp32, same kernels). The
    batch is large enough for the gap (0.74 GB measured) to stand well clear of the margin: at 8
    sequences it was 0.20 GB, and RSS noise under a full suite once made it 0.198."""
    config = {**TINY_LLAMA, "num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 256, "max_seq_len": 1024}
    peak, history = {}, {}
    for mode in ("none", "full"):
        run_json = write_run(
            tmp_path / mode, tokens, model={"config": config}, recompute=mode, train_steps=3,
            batch={"micro_batch_size": 16, "global_batch_size": 16, "seq_length": 1024},
            data={"split": [1, 0]}, eval={"every": 0},
        )  # fmt: skip
        ok(train(run_json, fresh=True))  # its own process: a peak resident set of its own
        rows = metrics(tmp_path / mode / "run")
        peak[mode], history[mode] = max(r["memory_gb"] for r in rows), [r["loss"] for r in rows]
    assert peak["full"] < peak["none"] - 0.2, peak
    assert_losses_close(history["full"], history["none"], rel=1e-6)


BAD_CASES = [
    (lambda r: r["batch"].update(micro_batch_size="2"), ["$.batch.micro_batch_size: expected int"]),
    (lambda r: r.update(learning_rate=1), ["unknown field learning_rate"]),
    (lambda r: r.pop("out"), ["missing required field"]),
    (lambda r: r["parallel"].update(tp=3), ["$.parallel.tp", "3"]),
    (lambda r: r["data"]["sources"].append({"path": "nowhere"}), ["nowhere", "no such artifact directory"]),
    (lambda r: r["model"]["config"].update(vocab_size=300), ["beyond the model's vocab_size 300"]),
    (lambda r: r["batch"].update(global_batch_size=9), ["$.batch.global_batch_size: 9 is not a multiple"]),
    (lambda r: r["eval"].update(every=5) or r["data"].update(split=[1, 0]), ["$.eval.every"]),
    (lambda r: r.update(attention="flash", precision="fp32"), ["$.attention: 'flash'", "precision is fp32"]),
    (
        lambda r: r.update(attention="flash", precision="bf16") or r["model"]["config"].update(attention={"type": "standard", "sinks": True}),
        ["$.attention: 'flash': the model has attention sinks", "use auto or sdpa"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(BAD_CASES)))
def test_invalid_manifests_exit_2_with_one_line(tmp_path: Path, tokens: Path, case: int) -> None:
    edit, fragments = BAD_CASES[case]
    run_json = write_run(tmp_path, tokens, parallel={"tp": 1, "pp": 1}, eval={"every": 0})
    run = json.loads(run_json.read_text())
    edit(run)
    run_json.write_text(json.dumps(run))
    assert_one_line_error(train(run_json), *fragments)
    assert not (tmp_path / "run").exists()  # nothing written before the checks pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_flash_attention_without_a_gpu_exits_2(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(tmp_path, tokens, attention="flash", precision="bf16")
    assert_one_line_error(train(run_json), "$.attention: 'flash' runs on a GPU and this machine has none")
    assert not (tmp_path / "run").exists()
    # The dry run makes the run's start-up checks: it says the same; planning other machines'
    # GPUs (--gpus) does not judge this one.
    assert_one_line_error(train(run_json, "--dry-run"), "$.attention: 'flash' runs on a GPU")
    ok(train(run_json, "--dry-run", "--gpus", "2", "--gpu-memory", "80GB"))


def test_invalid_manifest_under_torchrun_is_reported_once(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(tmp_path, tokens, batch={"global_batch_size": 6, "micro_batch_size": 2})
    proc = torchrun(2, run_json)
    assert proc.returncode != 0
    assert proc.stderr.count("mega-train: error: ") == 1, proc.stderr
    assert "$.batch.global_batch_size: 6 is not a multiple of micro_batch_size * dp = 2 * 2" in proc.stderr


def test_run_directory_of_someone_else_is_refused(tmp_path: Path, tokens: Path) -> None:
    run_json = write_run(tmp_path, tokens)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert_one_line_error(train(run_json), "$.out", "not a mega-train run directory")
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"seed": 7}, "$.seed differs from the run that saved"),
        ({"optimizer": {"lr": 1e-3}}, "$.optimizer.lr differs from the run that saved"),
        ({"batch": {"global_batch_size": 16}}, "$.batch.global_batch_size differs from the run that saved"),
        ({"data": {"split": [0.8, 0.2]}}, "$.data.split differs from the run that saved"),
        (
            {"model": {"config": {**TINY_LLAMA, "ffn_hidden_size": 96}}},
            "$.model.config.ffn_hidden_size differs",
        ),
    ],
    ids=["seed", "lr", "batch", "split", "config"],
)
def test_a_changed_run_refuses_to_resume_and_its_dry_run_says_so(
    tmp_path: Path, tokens: Path, reference: Path, change: dict, named: str
) -> None:
    """The launch and the dry run refuse the same resume, in the same line, exit 2."""
    run_json = write_run(tmp_path, tokens, **change)
    shutil.copytree(reference, tmp_path / "run")
    assert_one_line_error(train(run_json, "--dry-run"), named, "step-00000012")
    assert_one_line_error(train(run_json), named, "step-00000012")


def test_examples_plan(tmp_path: Path, tokens: Path) -> None:
    """examples/*.json are valid run manifests; the pretraining one plans for 8 processes against a
    tokens artifact where it expects one (after `make demo`), the others up to their checkpoint."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    (tmp_path / "examples").mkdir()
    (tmp_path / "demo-out").mkdir()
    (tmp_path / "demo-out" / "tokens").symlink_to(tokens)
    for name in ("pretrain.json", "finetune.json", "instruct.json"):
        shutil.copy(examples / name, tmp_path / "examples" / name)
    proc = run_tool(
        "mega-train", "--manifest", tmp_path / "examples" / "pretrain.json", "--dry-run", "--world-size", "8"
    )
    assert "world 8 = tp 2 x pp 2 x dp 2; batch 64 = micro 4 x dp 2 x accum 8" in ok(proc).stdout
    for name in ("finetune.json", "instruct.json"):  # valid up to the checkpoint `make demo` writes
        proc = run_tool("mega-train", "--manifest", tmp_path / "examples" / name, "--dry-run")
        assert_one_line_error(proc, "demo-out/ckpt-tp2pp2", "no such artifact directory")


# bench_train's 125M Llama: 12 layers, hidden 768, 12 heads (4 kv), ffn 2048, vocab 32000, untied.
LLAMA_125M = {"family": "llama", "vocab_size": 32000, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
              "num_kv_heads": 4, "ffn_hidden_size": 2048, "max_seq_len": 512}  # fmt: skip


def test_compile_auto_compiles_on_a_gpu_and_on_a_cpu_where_it_pays(tmp_path: Path, tokens: Path) -> None:
    """ "compile": "auto", the default: compiled on a GPU; on a CPU only when the run's compute,
    estimated at 0.36 TFLOP/s, reaches 10 minutes: not a tiny run, but 1,000 steps of 8 x 512
    tokens of a 125M Llama (its FLOPs worked out here from its shapes); true and false as given."""
    from mega_train.run_plan import plan_run

    tiny = plan_run(write_run(tmp_path / "tiny", tokens), 1)
    assert tiny.run.compile == "auto" and not tiny.compiles(gpu=False) and tiny.compiles(gpu=True)
    for given in (True, False):
        plan = plan_run(write_run(tmp_path / str(given), tokens, compile=given), 1)
        assert plan.compiles(gpu=False) is given and plan.compiles(gpu=True) is given
    batch = {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 512}
    big = write_run(tmp_path / "125m", tokens, model={"config": LLAMA_125M}, batch=batch, train_steps=1000)
    plan = plan_run(big, 1)
    h, kv, f, layers, vocab = 768, 256, 2048, 12, 32000
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * f) + vocab * h  # q, o, k, v, gate/up/down, head
    flops = 6 * matmul + 12 * layers * h * 512  # per token: PaLM's count, attention at S 512
    seconds = 1000 * 8 * 512 * flops / 0.36e12
    assert plan.cpu_run_seconds() == pytest.approx(seconds) and seconds > 600
    if not any(map(shutil.which, ("c++", "g++", "clang++"))):
        pytest.skip("no C++ compiler: compiling on a CPU cannot work here")
    assert plan.compiles(gpu=False)
    note = ok(run_tool("mega-train", "--manifest", big, "--dry-run")).stdout
    assert f"on a CPU it compiles (about {seconds / 60:.3g} minutes of compute estimated" in note


@pytest.mark.slow  # 39 s (a fresh process's first compile); make test: test_model_parity's compiled blocks
def test_a_compiled_run_reports_its_compile_time_apart(tmp_path: Path, tokens: Path) -> None:
    """With "compile": true the first step's record holds the seconds torch.compile took
    (`compile_s`), which its tokens/s leaves out; the later steps compile nothing."""
    run_json = write_run(tmp_path, tokens, compile=True, train_steps=3, checkpoint={"every": 3})
    out = ok(train(run_json, fresh=True)).stdout  # its own process: the first compile there
    rows = metrics(tmp_path / "run")
    first, later = rows[0], rows[1:]
    assert 1.0 < first["compile_s"] < first["step_time_s"], first
    assert all(r["compile_s"] < 0.05 for r in later), later
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / (r["step_time_s"] - r["compile_s"]))
    assert f"compiled in {first['compile_s']:.1f}s" in out
