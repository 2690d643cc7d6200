"""GPU training throughput of mega-train against what people train with instead, side by side in one
run: the same Llama, batch, data and precision (bf16) for every configuration.

Configurations, each in its own fresh subprocess (no memory or compile state carries over):
- mega-train eager and mega-train `"compile": true` (every block torch.compiled): `mega-train
  --manifest run.json`, bf16 compute copies of fp32 master weights, AdamW, clipping 1.0, recompute
  none, attention sdpa (benchlib's `measure_mega_train`).
- mega-train fp8 `"compile": true`: `"precision": "fp8"` (float8 matmuls in the blocks' linears,
  tensorwise scaling: megacore.parallel.fp8), against compiled bf16 (target 1.2x on the 3B). It
  needs torchao and a GPU of compute capability 8.9 or newer (an H200 is 9.0); elsewhere its row
  says it was skipped. A GPU machine without network gets torchao as a wheel carried with the
  tree (`pip install --no-deps torchao-*.whl`). Not in the 6-minute budget below: about 40 s more.
- HF Trainer: transformers' `Trainer` on `LlamaForCausalLM` (random init, attn_implementation
  "sdpa"), `bf16=True` (autocast over fp32 weights), optim "adamw_torch_fused", max_grad_norm 1.0,
  a cosine schedule (as mega-train's), the same micro batch and accumulation, no eval, saving or
  progress bar, report_to none; step ends from a `TrainerCallback` (on_step_end, after a CUDA
  synchronize). It needs accelerate: where that does not import, its row says so and nothing runs.
- plain loop: the fastest thing a user could write in an afternoon: the same `LlamaForCausalLM`
  (sdpa), `torch.compile(model)`, bf16 autocast over fp32 weights (the AMP recipe of PyTorch's
  docs, and the Trainer's `bf16=True`: no master-weight bookkeeping to write), fused AdamW with a
  cosine schedule, `clip_grad_norm_(1.0)`, loss / accumulation per micro batch.
- torchtitan: only where `import torchtitan` works; otherwise a row saying it is not installed.
  Where it is installed it is still not driven (its TOML job configs and model flavours change
  between releases): the row says so.

Models. On a GPU: a 1.1B Llama (TinyLlama's shape, benchlib's LLAMA_1B: hidden 2048, 22 layers, 32
heads, 4 kv heads, ffn 5632), micro batch 8 x 2 accumulation, and a 3B Llama (Llama 3.2 3B's shape:
hidden 3072, 28 layers, 24 heads, 8 kv heads, ffn 8192; untied, 3.0B parameters), micro batch 4 x 2
(the Trainer's fp32 weights, grads and moments take 48 GB, its activations ~9 GB a sequence by
estimate: micro 8 would not fit in 139 GB), both seq 2048, the tokens artifact's vocab (the
Mistral tokenizer's 32000). Without CUDA, or with `--quick`:
a tiny Llama (hidden 64, 2 layers, seq 64, micro 2 x 2, 1 warm-up + 2 timed steps).

Budget of the GPU run (one H200, under 8 minutes): one round, 2 warm-up + 8 timed optimizer steps
per configuration, 8 subprocesses (torchtitan runs nothing). FLOPs a token (flops_per_token, vocab
32000): 7.31 G (1.1B), 19.6 G (3B). Speeds: mega-train's 1.1B from bench_gpu's run (53,775 tokens/s
eager, 73,070 compiled); the rest assumed (MFU 30% Trainer, 45% plain loop, 40%/50% mega-train 3B),
not yet measured:
- steps, 1.1B (32,768 tokens a step): 10 x (0.61 eager + 0.45 compiled + 0.81 Trainer + 0.54 plain)
  = 24 s; 3B (16,384 tokens a step): 10 x (0.81 + 0.65 + 1.08 + 0.72) = 33 s
- starts: 8 x ~12 s (python, torch, transformers, CUDA context, weights, mega-train's plan) = 96 s
- compile warm-up (in the first step): mega-train one block a model (its blocks share one graph)
  2 x ~25 s, the plain loop the whole model 2 x ~50 s = 150 s
- mega-train's final checkpoint (fp32 weights + AdamW moments, 12 bytes a parameter: 13 GB and
  36 GB, deleted after each run), 2 runs a model, at ~2 GB/s: ~50 s
- the tokens artifact, when it is not there yet: ~10 s
- total ~365 s (6 min), 2 minutes of room for slower compiles or disks; inductor's cache makes a
  second run faster. Each configuration's wall time is logged to stderr, and the total at the end.

Figures per configuration: tokens/s = timed steps' tokens / their time (mega-train: the sum of the
`step_time_s` it logs; the others: from the end of the last warm-up step to the end of the last
step); TFLOP/s = tokens/s x `megacore.config.flops_per_token(config, seq)`, the same count for
every configuration; MFU against mega-train's peak table (`mega_train.metrics.peak_tflops`: 989
for an H100/H200 in bf16; none on a CPU: '-'); peak memory: torch.cuda.max_memory_allocated on a
GPU, the child's ru_maxrss on a CPU. Ratios: mega-train compiled vs the Trainer (target >= 1.3x)
and vs the compiled plain loop (target >= 1.0x), mega-train eager vs the Trainer. With more than
one round (`ROUNDS`), configurations run interleaved (benchlib's `paired_rounds`), the order
reversed every other round;
tokens/s is the median over rounds and a ratio is the quotient of the two medians shown.

Run it on a GPU machine that has torch and transformers but not our console scripts, from the
repository root (the tokens artifact is made on the first run with mega-tokenize; a machine
without a tokenizer can be given bench-out/gpu/tokens ready made, shared with bench_gpu):

  PYTHONPATH=libs/megacore/src:tools/mega-train/src:tools/mega-tokenize/src python bench/bench_gpu_peers.py

`--quick` selects the tiny shapes on any machine; `python bench/run.py gpu_peers` runs it too.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchlib import (
    LLAMA_1B,
    ROOT,
    Setup,
    Text,
    gpu_data,
    hf_llama,
    load_rows,
    logger,
    main,
    measure_child,
    measure_mega_train,
    ours_config,
    paired_rounds,
    rows_file,
    text_data,
    tokens_per_s,
    trainer_feed,
)
from run import Row

OUT = ROOT / "bench-out" / "gpu-peers"
BENCH = "gpu_peers"
ROUNDS = 1  # the GPU budget holds one; the figures of an H200 vary far less than this CPU's
MODELS = {
    "1.1B": replace(LLAMA_1B, warmup=2, timed=8, rounds=ROUNDS),
    "3B": Setup(
        hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, seq=2048, micro=4, accum=2, warmup=2,
        timed=8, rounds=ROUNDS,
    ),
}  # fmt: skip
TINY = Setup(
    hidden=64, layers=2, heads=4, kv_heads=2, ffn=192, seq=64, micro=2, accum=2, warmup=1, timed=2, rounds=1
)
LABELS = {
    "mega": "mega-train eager",
    "mega-compiled": 'mega-train "compile": true',
    "mega-fp8": 'mega-train fp8 "compile": true',
    "hf": "HF Trainer",
    "plain": "plain loop, torch.compile",
    "torchtitan": "torchtitan",
}
# A failure of ours fails the run (fp8 where it cannot run is skipped); a peer's is its row's note.
OURS = ("mega", "mega-compiled", "mega-fp8")
# Each of ours next to the peer it is compared with.
ORDER = ("mega", "hf", "mega-compiled", "mega-fp8", "plain")
ORDER_SHOWN = ("mega", "mega-compiled", "mega-fp8", "hf", "plain")
RATIOS = (  # (ours, peer, target)
    ("mega-compiled", "hf", ">= 1.3x"),
    ("mega-compiled", "plain", ">= 1.0x"),
    ("mega", "hf", ""),
    ("mega-fp8", "mega-compiled", ">= 1.2x (3B)"),  # float8 matmuls against bf16's, both compiled
)


log = logger(BENCH)


def data(quick: bool) -> Text:
    """benchlib's `gpu_data` (bench-out/gpu/tokens, 8 MB of text) for the GPU models; for the tiny
    one 1 MB of text in OUT. Made on the first run, then reused."""
    return text_data(OUT / "quick", 1 << 20, workers=None) if quick else gpu_data()


# --- the children: `bench_gpu_peers.py --child KIND SPEC` ----------------------------------------


def step_end() -> float:
    """The time a step ended, once the GPU has finished it (kernels run asynchronously)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def finish(setup: Setup, model, ends: list[float], **extra) -> dict:
    import torch

    memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    params = sum(p.numel() for p in model.parameters())
    return {"tokens_per_s": tokens_per_s(setup, ends), "params": params, "memory": memory, **extra}


def child_hf(setup: Setup, spec: dict) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    dataset, callback = trainer_feed(setup, spec, clock=step_end)
    cuda = torch.cuda.is_available()
    model = hf_llama(setup, "cuda" if cuda else "cpu")
    args = TrainingArguments(
        output_dir=spec["work"], max_steps=setup.steps, per_device_train_batch_size=setup.micro,
        gradient_accumulation_steps=setup.accum, learning_rate=3e-4, bf16=True, use_cpu=not cuda,
        optim="adamw_torch_fused", max_grad_norm=1.0, report_to="none", dataloader_num_workers=0,
        lr_scheduler_type="cosine", save_strategy="no", eval_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
    return finish(setup, model, callback.ends)


def child_plain(setup: Setup, spec: dict) -> dict:
    import torch

    rows, device = load_rows(spec), "cuda" if torch.cuda.is_available() else "cpu"
    model = hf_llama(setup, device)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, setup.steps)
    ends = []
    for step in range(setup.steps):
        batch = rows[step * setup.global_batch :][: setup.global_batch, : setup.seq].to(device)
        for micro in batch.split(setup.micro):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = compiled(input_ids=micro, labels=micro).loss
            (loss / setup.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        ends.append(step_end())
    return finish(setup, model, ends, last_loss=loss.item())


CHILDREN = {"hf": child_hf, "plain": child_plain}


# --- running the configurations ------------------------------------------------------------------


def missing(kind: str) -> str | None:
    """Why a peer cannot run in this python, or None."""
    need = {"hf": ("transformers", "accelerate"), "plain": ("transformers",), "torchtitan": ("torchtitan",)}
    absent = [m for m in need.get(kind, ()) if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    what = "transformers' Trainer needs " if kind == "hf" else ""
    return f"not installed: {what}{' and '.join(absent)} (import failed in {sys.executable})"


def measure_one(kind: str, setup: Setup, tokens: Path, rows: Path, work: Path) -> dict:
    """tokens_per_s and memory (bytes, and which kind) of one configuration, or {"error": ...}."""
    import torch

    cuda = torch.cuda.is_available()
    if kind == "mega-fp8" and (why := fp8_missing()):
        return {"error": why, "skipped": True}
    if kind.startswith("mega"):
        fp8 = {"precision": "fp8"} if kind == "mega-fp8" else {}
        res = measure_mega_train(setup, tokens, work, compile=kind != "mega", attention="sdpa", **fp8)
        if "records" in res:  # memory_gb: torch.cuda's peak allocated on a GPU
            res["memory"] = max(r["memory_gb"] for r in res.pop("records")) * 1e9 if cuda else res["rss"]
    else:
        why = missing(kind)
        # One peer in a fresh subprocess (this file with `--child KIND SPEC`).
        res = (
            {"error": why}
            if why
            else measure_child(Path(__file__), kind, setup, rows, work, distributed=False)
        )
        if "tokens_per_s" in res and not cuda:
            res["memory"] = res["rss"]
    res["memory_kind"] = "GPU allocated" if cuda else "RSS"
    return res


def fp8_missing() -> str:
    """Why mega-train's fp8 cannot run here ('' when it can): torchao, and float8 matmuls."""
    import torch

    if importlib.util.find_spec("torchao") is None:
        return "skipped: fp8 needs torchao (pip install torchao)"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return "skipped: fp8 needs a GPU with float8 matmuls (compute capability 8.9 or newer)"
    return ""


def measure_rounds(setup: Setup, tokens: Path, rows: Path, work: Path) -> dict[str, list[dict]]:
    """Every configuration once per round, in ORDER, reversed every other round."""

    def measure(kind: str, r: int) -> dict:
        return measure_one(kind, setup, tokens, rows, work / f"{kind}-{r}")

    return paired_rounds(ORDER, setup.rounds, measure, log=log)


# --- rows ----------------------------------------------------------------------------------------


def shown(x: float) -> str:
    """A tokens/s figure as a row shows it (a slow CPU's below 100 keeps 3 digits)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def speed(runs: list[dict]) -> float | None:
    """The median tokens/s over the rounds, None when a round failed."""
    if any("error" in r for r in runs):
        return None
    return statistics.median(r["tokens_per_s"] for r in runs)


def error(runs: list[dict]) -> str:
    return next(r["error"] for r in runs if "error" in r)


def config_row(name: str, kind: str, runs: list[dict], flops: float, peak: float | None) -> Row:
    """tokens/s of one configuration; TFLOP/s, MFU and peak memory in its note."""
    metric = f"{name}: {LABELS[kind]}, tokens/s"
    tps = speed(runs)
    if tps is None:
        failed = kind in OURS and not any(r.get("skipped") for r in runs)
        return Row(BENCH, metric, "-", "-", None, note=error(runs), passed=False if failed else None)
    tflops = tps * flops / 1e12
    mfu = f"MFU {100 * tflops / peak:.1f}%" if peak else "MFU -"
    memory = f"peak {max(r['memory'] for r in runs) / 1e9:.2f} GB ({runs[0]['memory_kind']})"
    return Row(BENCH, metric, shown(tps), "-", None, note=f"{tflops:.3g} TFLOP/s; {mfu}; {memory}")


def ratio_row(name: str, ours: str, peer: str, target: str, results: dict[str, list[dict]]) -> Row:
    """ours / peer in tokens/s, from the two medians the row shows."""
    metric = f"{name}: {LABELS[ours]} vs {LABELS[peer]}, tokens/s"
    a, b = speed(results[ours]), speed(results[peer])
    if a is None or b is None:
        side = ours if a is None else peer
        failed = f"{LABELS[side]}: {error(results[side])}"
        return Row(BENCH, metric, "-" if a is None else shown(a), "-", None, target, failed)
    # The quotient of the figures as shown, so that it reads off the row exactly.
    ratio = float(shown(a).replace(",", "")) / float(shown(b).replace(",", ""))
    return Row(BENCH, metric, shown(a), shown(b), ratio, target)


def torchtitan_row(name: str) -> Row:
    why = missing("torchtitan")
    if not why:
        import torchtitan

        version = getattr(torchtitan, "__version__", "?")
        why = f"installed ({version}) but not driven by this benchmark: its job configs vary by release"
    return Row(BENCH, f"{name}: {LABELS['torchtitan']}, tokens/s", "-", "-", None, note=why)


def model_rows(name: str, setup: Setup, quick: bool) -> list[Row]:
    """Every configuration on one model: a row each, then the ratios."""
    from mega_train.metrics import peak_tflops
    from megacore.config import ModelConfig
    from megacore.planner.counts import flops_per_token, parameter_counts

    text = data(quick)
    tokens, vocab = text.tokens, text.vocab
    setup, work = replace(setup, vocab=vocab), OUT / "work" / name
    rows = rows_file(setup, tokens, work)
    config = ModelConfig(**ours_config(setup))
    flops = flops_per_token(config, setup.seq)  # one FLOP count for every configuration: ours
    peak = peak_tflops(None, "bf16")
    results = measure_rounds(setup, tokens, rows, work)
    label = f"{name} Llama"
    out = [config_row(label, kind, results[kind], flops, peak) for kind in ORDER_SHOWN]
    out.append(torchtitan_row(label))
    out += [ratio_row(label, o, p, t, results) for o, p, t in RATIOS]
    shape = f"{setup.micro}x{setup.accum}x{setup.seq} tokens/step, vocab {vocab}, bf16"
    out[0].note += f"; {shape}, {setup.warmup} warm-up + {setup.timed} timed steps, {setup.rounds} round(s)"
    ours = parameter_counts(config)[0]
    other = {LABELS[k]: r["params"] for k, v in results.items() for r in v if r.get("params", ours) != ours}
    if other:  # the same model everywhere, or the comparison says it is not
        out[0].note += f"; parameter counts differ from ours ({ours:,}): {other}"
    return out


def absolute_pythonpath() -> None:
    """The children run in their own work directories: PYTHONPATH's relative entries (the GPU
    command line's) are made absolute so that they still find the sources."""
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(str(Path(e).resolve()) for e in entries)


def run(quick: bool) -> list[Row]:
    import torch

    absolute_pythonpath()
    cuda = torch.cuda.is_available()
    models = MODELS if cuda and not quick else {"tiny": TINY}
    log(f"{torch.cuda.get_device_name() if cuda else 'no CUDA: CPU'}; models {', '.join(models)}")
    t0, rows = time.perf_counter(), []
    for name, setup in models.items():
        rows += model_rows(name, setup, quick or not cuda)
    log(f"all configurations: {time.perf_counter() - t0:.0f}s")
    return rows


if __name__ == "__main__":
    main(run, CHILDREN)
