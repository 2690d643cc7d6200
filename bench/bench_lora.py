"""A LoRA fine-tuning step against transformers + PEFT under transformers' `Trainer`.

The same 125M Llama as bench_train (hidden 768, 12 layers, 12 heads, 4 kv heads, ffn 2048, the
tokenizer's vocab; `--quick`: 2 layers, hidden 128, seq 128), random weights saved by transformers
and converted with `mega-convert hf` (the base both load); the same adapters: rank 16, alpha 32,
dropout 0.05 on all seven projections (q/k/v/o, gate/up/down), as PEFT's `LoraConfig` and our
`lora` section say it; the same batch (micro batch 4 x 2 accumulation of 512 tokens) and the same
token rows (benchlib's `prepare_data`), one process, 2 threads. bf16 compute where the CPU
multiplies bf16 (benchlib's `cpu_precision`); elsewhere both sides run fp32 (1 warm-up step, 3
timed: an fp32 step takes several times a bf16 one), and the note says so.

- mega-train: `mega-train --manifest run.json` with `"lora"` beside `"model": {"init": BASE}`,
  precision bf16 (bf16 compute, the frozen base held in bf16 alone; the adapters' fp32 master
  weights and AdamW moments) or fp32, recompute none; tokens/s from the `step_time_s` it logs
  (benchlib's `measure_mega_train`).
- Trainer + PEFT: `get_peft_model(AutoModelForCausalLM.from_pretrained(BASE_HF), LoraConfig(...))`
  under `Trainer` with `bf16=True` (autocast; False in fp32), `use_cpu=True`, its default
  optimizer (fused torch AdamW over the trainable parameters), a cosine schedule, otherwise its
  defaults; tokens/s from the wall time between its step ends (a `TrainerCallback`), as
  bench_train's Trainer row.

Each configuration in a fresh subprocess, 2 warm-up steps then 6 timed (`--quick`: 1 and 2), in
interleaved rounds (benchlib's `paired_rounds`: the order reversed every other round), ROUNDS of
them (`--quick`: 1): tokens/s shown are each side's best round, the ratio the median over rounds of
ours / theirs in the same round. Peak RSS: each child's own (benchlib's `launch`), the larger
over rounds; the ratio is theirs / ours (above 1: we hold less).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from benchlib import (
    OUT,
    THREADS,
    Setup,
    cpu_precision,
    cpu_setup,
    failure,
    gb,
    logger,
    lora_base,
    main,
    measure_child,
    measure_mega_train,
    median_ratio,
    paired_rounds,
    prepare_data,
    rounds_note,
    tokens_per_s,
    trainer_feed,
)
from run import Row

WORK = OUT / "lora"
ROUNDS = 3
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip


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
    def measure(kind: str, r: int) -> dict:
        work = WORK / "work" / f"{kind}-{r}"
        if kind == "mega":
            return measure_ours(setup, tokens, ckpt, work, precision)
        return measure_child(Path(__file__), kind, setup, rows, work, hf=str(hf), precision=precision)

    return paired_rounds(("mega", "peft"), setup.rounds, measure, log=logger("lora"))


def rows_of(results: dict[str, list[dict]], note: str) -> list[Row]:
    metric = "LoRA step tokens/s, mega-train vs Trainer + PEFT"
    memory = "LoRA peak RSS, mega-train vs Trainer + PEFT"
    if failed := failure(results):
        side, error = failed
        why = f"{'mega-train' if side == 'mega' else 'Trainer + PEFT'} failed: {error}"
        return [Row("lora", m, "-", "-", None, t, why, False if side == "mega" else None)
                for m, t in ((metric, ">= 1.3x"), (memory, "> 1x"))]  # fmt: skip
    ours, theirs = ([r["tokens_per_s"] for r in results[k]] for k in ("mega", "peft"))
    ratio, rounds = median_ratio(ours, theirs), rounds_note(ours, theirs)
    trained = f"{results['peft'][0]['trained']:,} adapter parameters (PEFT's count)"
    rss_ours, rss_theirs = (max(r["rss"] for r in results[k]) for k in ("mega", "peft"))
    return [
        Row("lora", metric, f"{max(ours):.0f}", f"{max(theirs):.0f}", ratio, ">= 1.3x", f"{note}; {trained}; {rounds}"),
        Row("lora", memory, gb(rss_ours), gb(rss_theirs), rss_theirs / rss_ours, "> 1x", note),
    ]  # fmt: skip


def run(quick: bool, rounds: int = ROUNDS) -> list[Row]:
    setup, precision = cpu_setup(quick, 1 if quick else rounds), cpu_precision()
    tokens, rows, vocab = prepare_data(setup)
    setup = replace(setup, vocab=vocab)
    WORK.mkdir(parents=True, exist_ok=True)
    hf, ckpt = lora_base(setup)
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
    main(run, {"peft": child_peft})
