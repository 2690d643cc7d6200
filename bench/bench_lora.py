"""A LoRA fine-tuning step against transformers + PEFT under transformers' `Trainer`.

The same 125M Llama as bench_train (hidden 768, 12 layers, 12 heads, 4 kv heads, ffn 2048, the
tokenizer's vocab; `--quick`: 2 layers, hidden 128, seq 128), random weights saved by transformers
and converted with `mega-convert hf` (the base both load); the same adapters: rank 16, alpha 32,
dropout 0.05 on all seven projections (q/k/v/o, gate/up/down), as PEFT's `LoraConfig` and our
`lora` section say it; the same batch (micro batch 4 x 2 accumulation of 512 tokens) and the same
token rows (bench_train's `prepare_data`), one process, 2 threads. bf16 compute where the CPU
multiplies bf16 (`bench_train.cpu_precision`); elsewhere both sides run fp32 (1 warm-up step, 3 timed: an
fp32 step takes several times a bf16 one), and the note says so.

- mega-train: `mega-train --manifest run.json` with `"lora"` beside `"model": {"init": BASE}`,
  precision bf16 (bf16 compute, the frozen base held in bf16 alone; the adapters' fp32 master
  weights and AdamW moments) or fp32, recompute none; tokens/s from the `step_time_s` it logs
  (bench_train's `measure_mega_train`).
- Trainer + PEFT: `get_peft_model(AutoModelForCausalLM.from_pretrained(BASE_HF), LoraConfig(...))`
  under `Trainer` with `bf16=True` (autocast; False in fp32), `use_cpu=True`, its default
  optimizer (fused torch AdamW over the trainable parameters), a cosine schedule, otherwise its
  defaults; tokens/s from the wall time between its step ends (a `TrainerCallback`), as
  bench_train's Trainer row.

Each configuration in a fresh subprocess, 2 warm-up steps then 6 timed (`--quick`: 1 and 2), in
interleaved rounds (the order reversed every other round), ROUNDS of them (`--quick`: 1): tokens/s
shown are each side's best round, the ratio the median over rounds of ours / theirs in the same
round. Peak RSS: each child's own (`ru_maxrss`, bench_train's `launch`), the larger over rounds;
the ratio is theirs / ours (above 1: we hold less).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench_train import (
    BIN,
    FULL,
    OUT,
    QUICK,
    THREADS,
    Setup,
    child_main,
    cpu_precision,
    gb,
    hf_llama,
    measure,
    measure_mega_train,
    prepare_data,
    tokens_per_s,
    trainer_feed,
)
from run import Row

WORK = OUT.parent / "lora"
ROUNDS = 3
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip


def log(msg: str) -> None:
    print(f"   lora: {msg}", file=sys.stderr, flush=True)


def base(setup: Setup) -> tuple[Path, Path]:
    """The random Llama as transformers saves it, and converted: (HF directory, checkpoint)."""
    hf, ckpt = WORK / f"base-hf-{setup.layers}x{setup.hidden}", WORK / f"base-{setup.layers}x{setup.hidden}"
    if not (ckpt / "manifest.json").is_file():
        hf_llama(setup).save_pretrained(hf)
        subprocess.run(
            [BIN / "mega-convert", "hf", hf, ckpt, "--force"], check=True, stdout=subprocess.DEVNULL
        )
    return hf, ckpt


def child_peft(setup: Setup, spec: dict) -> dict:
    """transformers + PEFT under the Trainer (the module docstring), in this subprocess."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    dataset, callback = trainer_feed(setup, spec)
    torch.manual_seed(0)
    lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["targets"], task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(spec["hf"], attn_implementation="sdpa"), lora)
    args = TrainingArguments(
        output_dir=spec["work"], max_steps=setup.steps, per_device_train_batch_size=setup.micro,
        gradient_accumulation_steps=setup.accum, learning_rate=2e-4, bf16=spec["precision"] == "bf16", use_cpu=True,
        report_to="none", dataloader_num_workers=0, save_strategy="no", eval_strategy="no", seed=0,
        lr_scheduler_type="cosine",
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"tokens_per_s": tokens_per_s(setup, callback.ends), "trained": trained}


def measure_ours(setup: Setup, tokens: Path, ckpt: Path, work: Path, precision: str) -> dict:
    res = measure_mega_train(setup, tokens, work, model={"init": str(ckpt)}, lora=LORA, precision=precision,
                             optimizer={"lr": 2e-4, "warmup_steps": 0})  # fmt: skip
    res.pop("records", None)
    return res


def measure_rounds(
    setup: Setup, tokens: Path, rows: Path, hf: Path, ckpt: Path, precision: str
) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"mega": [], "peft": []}
    for r in range(setup.rounds):
        for kind in ("mega", "peft") if r % 2 == 0 else ("peft", "mega"):
            t, work = time.perf_counter(), WORK / "work" / f"{kind}-{r}"
            if kind == "mega":
                res = measure_ours(setup, tokens, ckpt, work, precision)
            else:
                res = measure(kind, setup, rows, Path(sys.executable), work, Path(__file__), hf=str(hf),
                              precision=precision)  # fmt: skip
            results[kind].append(res)
            log(f"round {r + 1}/{setup.rounds} {kind}: { {k: v for k, v in res.items() if k != 'rss'} } "
                f"({time.perf_counter() - t:.0f}s)")  # fmt: skip
    return results


def rows_of(results: dict[str, list[dict]], note: str) -> list[Row]:
    metric = "LoRA step tokens/s, mega-train vs Trainer + PEFT"
    memory = "LoRA peak RSS, mega-train vs Trainer + PEFT"
    for side, runs in results.items():
        failed = [r["error"] for r in runs if "error" in r]
        if failed:
            why = f"{'mega-train' if side == 'mega' else 'Trainer + PEFT'} failed: {failed[0]}"
            return [Row("lora", m, "-", "-", None, t, why, False if side == "mega" else None)
                    for m, t in ((metric, ">= 1.3x"), (memory, "> 1x"))]  # fmt: skip
    ours, theirs = ([r["tokens_per_s"] for r in results[k]] for k in ("mega", "peft"))
    ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    rounds = f"rounds {'/'.join(f'{x:.0f}' for x in ours)} vs {'/'.join(f'{x:.0f}' for x in theirs)}"
    trained = f"{results['peft'][0]['trained']:,} adapter parameters (PEFT's count)"
    rss_ours, rss_theirs = (max(r["rss"] for r in results[k]) for k in ("mega", "peft"))
    return [
        Row("lora", metric, f"{max(ours):.0f}", f"{max(theirs):.0f}", ratio, ">= 1.3x", f"{note}; {trained}; {rounds}"),
        Row("lora", memory, gb(rss_ours), gb(rss_theirs), rss_theirs / rss_ours, "> 1x", note),
    ]  # fmt: skip


def run(quick: bool, rounds: int = ROUNDS) -> list[Row]:
    setup = replace(QUICK if quick else FULL, rounds=1 if quick else rounds)
    precision = cpu_precision()
    if precision == "fp32" and not quick:  # fp32 steps take 4x a bf16 one on a CPU with AMX
        setup = replace(setup, warmup=1, timed=3)
    tokens, rows, vocab = prepare_data(setup)
    setup = Setup(**{**asdict(setup), "vocab": vocab})
    WORK.mkdir(parents=True, exist_ok=True)
    hf, ckpt = base(setup)
    note = (
        f"{'quick: tiny Llama' if quick else '125M Llama'}, {setup.micro}x{setup.accum}x{setup.seq} tokens/step, "
        f"rank {LORA['rank']} on 7 projections, {precision}, {THREADS} threads, {setup.timed} timed steps"
    )
    if precision == "fp32":
        note += " (this CPU has no bf16 matmul: AMX or AVX512-BF16)"
    return rows_of(measure_rounds(setup, tokens, rows, hf, ckpt, precision), note)


def check(rounds: int) -> list[Row]:
    """The guarded rows (bench/check.py): `run`'s, in `rounds` paired rounds."""
    return run(False, rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2], sys.argv[3], {"peft": child_peft})
    else:
        from run import main

        sys.exit(main(["lora", *sys.argv[1:]]))
