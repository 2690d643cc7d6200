"""A DPO step against TRL's DPOTrainer on the same pairs, the reference precomputed on both sides.

The same 125M Llama as bench_lora (its base, benchlib's `lora_base`: random weights saved by
transformers and converted; `--quick`: 2 layers, hidden 128, seq 128), fully fine-tuned. The pairs
come from the CPU training benchmarks' corpus (benchlib's `train_data`: the Python standard
library's sources), one per file: the prompt its first characters, the chosen completion the next
ones, the rejected one the same span of the next file (PROMPT and COMPLETION characters per token
of the row), so the sequences vary in length as real pairs do (TRL's mean pair length in the
note). TRL's standard rows (`{"prompt", "chosen", "rejected"}` strings): `mega-tokenize --format
preference --prepend-bos` for us, the same rows for TRL, which tokenizes them itself (BOS from the
tokenizer, EOS added to each completion as ours is). Micro batch 4 pairs x 2 accumulation, seq
512, one process, 2 threads, bf16 where the CPU multiplies bf16 (benchlib's `cpu_precision`), else
fp32 on both sides.

- mega-train: `"objective": {"type": "dpo", "beta": 0.1}` beside `"model": {"init": BASE}`; its
  reference's log-probabilities computed before the first step (not timed); pairs/s from the
  `step_time_s` it logs after the warm-up steps.
- TRL: `DPOTrainer(model=BASE_HF, args=DPOConfig(...))` as its users run it: beta 0.1,
  `precompute_ref_log_probs=True` (before training, not timed), `max_length` the row's, bf16 (or
  not), `use_cpu`, its defaults otherwise (AdamW, linear schedule, each batch padded to its longest
  sequence); pairs/s from the wall time between its step ends (a `TrainerCallback`).

Each configuration in a fresh subprocess, 1 warm-up step then 3 timed (`--quick`: 1 and 2), in
interleaved rounds (benchlib's `paired_rounds`: the order reversed every other round), ROUNDS of
them (`--quick`: 1): pairs/s shown are each side's best round, the ratio the median over rounds of
ours / theirs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from benchlib import (
    LLAMA_125M,
    LLAMA_TINY,
    OUT,
    THREADS,
    Setup,
    cpu_precision,
    failure,
    hf_tokenizer,
    logger,
    lora_base,
    main,
    measure_child,
    measure_mega_train,
    median_ratio,
    paired_rounds,
    prepare_data,
    rounds_note,
    tokenize,
    train_data,
    trainer_feed,
)
from run import Row

WORK = OUT / "dpo"
ROUNDS = 3
# Characters of Python source per token of the row (seq): the prompt 1.2, each completion 1.0 (at
# some 3.5 characters a token, sequences of about 60% of a row, varying with the file).
PROMPT, COMPLETION = 1.2, 1.0


def pairs_jsonl(setup: Setup) -> Path:
    """One pair per corpus file with enough text, as many as the run's steps take."""
    path = WORK / f"pairs-{setup.steps * setup.global_batch}x{setup.seq}.jsonl"
    if path.exists():
        return path
    texts = [json.loads(line)["text"] for line in train_data().corpus.read_text().splitlines()]
    p, c = int(PROMPT * setup.seq), int(COMPLETION * setup.seq)
    texts = [t for t in texts if len(t) >= p + c]
    rows = []
    for i in range(setup.steps * setup.global_batch):
        a, b = texts[i % len(texts)], texts[(i + 1) % len(texts)]
        rows.append({"prompt": a[:p], "chosen": a[p : p + c], "rejected": b[p : p + c]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def child_trl(setup: Setup, spec: dict) -> dict:
    """TRL's DPOTrainer (the module docstring), in this subprocess."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(spec["pairs"]).read_text().splitlines()]
    _, callback = trainer_feed(setup, {**spec, "rows": spec["rows"]})
    torch.manual_seed(0)
    args = DPOConfig(
        output_dir=spec["work"], per_device_train_batch_size=setup.micro, gradient_accumulation_steps=setup.accum,
        max_steps=setup.steps, learning_rate=5e-7, beta=0.1, precompute_ref_log_probs=True,
        max_length=setup.seq + 1, bf16=spec["precision"] == "bf16", use_cpu=True, report_to="none",
        save_strategy="no", eval_strategy="no", dataloader_num_workers=0, seed=0, logging_steps=1,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    trainer = DPOTrainer(
        model=spec["hf"],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[callback],
    )
    lengths = [
        len(r["prompt_ids"]) + (len(r["chosen_ids"]) + len(r["rejected_ids"])) / 2
        for r in trainer.train_dataset
    ]
    trainer.train()
    ends = callback.ends
    timed = setup.timed * setup.global_batch
    return {
        "pairs_per_s": timed / (ends[-1] - ends[setup.warmup - 1]),
        "mean_length": sum(lengths) / len(lengths),
    }


def measure_ours(setup: Setup, pairs: Path, ckpt: Path, work: Path, precision: str) -> dict:
    res = measure_mega_train(setup, pairs, work, model={"init": str(ckpt)}, precision=precision,
                             objective={"type": "dpo", "beta": 0.1}, optimizer={"lr": 5e-7, "warmup_steps": 0})  # fmt: skip
    if "error" in res:
        return res
    seconds = sum(r["step_time_s"] for r in res.pop("records"))
    return {"pairs_per_s": setup.timed * setup.global_batch / seconds, "rss": res["rss"]}


def measure_rounds(
    setup: Setup, pairs: Path, tokens: Path, rows: Path, hf: Path, ckpt: Path, precision: str
) -> dict:
    tok = hf_tokenizer(train_data().tokenizer, WORK / "hf-tokenizer")

    def measure(kind: str, r: int) -> dict:
        work = WORK / "work" / f"{kind}-{r}"
        if kind == "mega":
            return measure_ours(setup, tokens, ckpt, work, precision)
        return measure_child(Path(__file__), kind, setup, rows, work, hf=str(hf), precision=precision,
                             pairs=str(pairs), tokenizer=str(tok))  # fmt: skip

    return paired_rounds(("mega", "trl"), setup.rounds, measure, log=logger("dpo"))


def rows_of(results: dict[str, list[dict]], note: str) -> list[Row]:
    metric, target = "DPO step pairs/s, mega-train vs TRL DPOTrainer", ">= 1.3x"
    if failed := failure(results):
        side, error = failed
        why = f"{'mega-train' if side == 'mega' else 'TRL'} failed: {error}"
        return [Row("dpo", metric, "-", "-", None, target, why, False if side == "mega" else None)]
    ours, theirs = ([r["pairs_per_s"] for r in results[k]] for k in ("mega", "trl"))
    ratio, rounds = median_ratio(ours, theirs), rounds_note(ours, theirs, 2)
    length = f"TRL's mean pair length {results['trl'][0]['mean_length']:.0f} tokens"
    return [
        Row(
            "dpo",
            metric,
            f"{max(ours):.2f}",
            f"{max(theirs):.2f}",
            ratio,
            target,
            f"{note}; {length}; {rounds}",
        )
    ]


def run(quick: bool, rounds: int = ROUNDS) -> list[Row]:
    setup = replace(
        LLAMA_TINY if quick else LLAMA_125M, rounds=1 if quick else rounds, warmup=1, timed=2 if quick else 3
    )
    precision = cpu_precision()
    _, rows, vocab = prepare_data(setup)  # the corpus and tokenizer (rows: what trainer_feed reads)
    setup = replace(setup, vocab=vocab)
    WORK.mkdir(parents=True, exist_ok=True)
    hf, ckpt = lora_base(setup)
    pairs = pairs_jsonl(setup)
    tokens = WORK / f"tokens-{pairs.stem}"
    tokenize(pairs, tokens, train_data().tokenizer, "--format", "preference", "--prepend-bos")
    note = (
        f"{'quick: tiny Llama' if quick else '125M Llama'}, {setup.micro}x{setup.accum} pairs/step, seq {setup.seq}, "
        f"full fine-tuning, {precision}, {THREADS} threads, {setup.timed} timed steps"
    )
    return rows_of(measure_rounds(setup, pairs, tokens, rows, hf, ckpt, precision), note)


def check(rounds: int) -> list[Row]:
    """The guarded row (bench/check.py): `run`'s, in `rounds` paired rounds."""
    return run(False, rounds)


if __name__ == "__main__":
    main(run, {"trl": child_trl})
