"""A GRPO step (sampling, scoring and the update) against TRL's GRPOTrainer on the same prompts.

The 125M Llama of bench_lora and bench_dpo (benchlib's `lora_base`: random weights saved by
transformers and converted; `--quick`: 2 layers, hidden 128), fully fine-tuned, its completions
sampled at temperature 1 from prompts of the CPU benchmarks' corpus (benchlib's `train_data`: the
Python standard library's sources; PROMPT characters each, about 45 tokens; rows of SEQ tokens): 2 prompts a step (micro
batch 1 prompt x 2 accumulation), 4 completions each, up to COMPLETION new tokens (a random model
rarely stops before), one reward function on both sides (the completion's length in characters),
beta 0, loss dapo (TRL's defaults), one process, 2 threads, bf16 where the CPU multiplies bf16
(benchlib's `cpu_precision`), else fp32 on both sides.

- mega-train: `"objective": {"type": "grpo", ...}` beside `"model": {"init": BASE}`, the prompts
  from `mega-tokenize --format prompts`, its sampler with a KV cache; steps/s from the
  `step_time_s` it logs after the warm-up steps (each step samples, scores and updates).
- TRL: `GRPOTrainer(model=BASE_HF, reward_funcs=length, args=GRPOConfig(...))` as its users run it
  without vLLM (transformers' `generate` with its cache): the same batch, generations, lengths and
  temperature, `use_cpu`, bf16 (or not), its defaults otherwise; steps/s from the wall time between
  its step ends (a `TrainerCallback`).

Each configuration in a fresh subprocess, 1 warm-up step then 2 timed, in interleaved rounds
(benchlib's `paired_rounds`), ROUNDS of them (`--quick`: 1): steps/s shown are each side's best
round, the ratio the median over rounds of ours / theirs.
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

WORK = OUT / "grpo"
ROUNDS = 3
G, COMPLETION, PROMPT, SEQ = (
    4,
    64,
    160,
    128,
)  # completions a prompt, their most tokens, a prompt's characters, a row
REWARD = "def length(completions, **_):\n    return [float(len(c)) for c in completions]\n"


def prompts_jsonl(setup: Setup) -> Path:
    """A prompt per corpus file with enough text, as many as the run's steps take."""
    path = WORK / f"prompts-{setup.steps * setup.global_batch}.jsonl"
    if path.exists():
        return path
    texts = [json.loads(line)["text"] for line in train_data().corpus.read_text().splitlines()]
    texts = [t for t in texts if len(t) >= PROMPT]
    rows = [{"prompt": texts[i % len(texts)][:PROMPT]} for i in range(setup.steps * setup.global_batch)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def child_trl(setup: Setup, spec: dict) -> dict:
    """TRL's GRPOTrainer (the module docstring), in this subprocess."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    _, callback = trainer_feed(setup, spec)
    namespace: dict = {}
    exec(REWARD, namespace)  # the reward mega-train reads from its file
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=spec["work"], per_device_train_batch_size=setup.micro * G,
        gradient_accumulation_steps=setup.accum, num_generations=G, max_completion_length=COMPLETION,
        temperature=1.0, max_steps=setup.steps, learning_rate=1e-6, bf16=spec["precision"] == "bf16",
        use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no", dataloader_num_workers=0,
        seed=0, logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=spec["hf"], reward_funcs=namespace["length"], args=args, train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["tokenizer"]), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    ends = callback.ends
    return {"steps_per_s": setup.timed / (ends[-1] - ends[setup.warmup - 1])}


def measure_ours(setup: Setup, tokens: Path, ckpt: Path, work: Path, precision: str) -> dict:
    (WORK / "rewards.py").write_text(REWARD)  # beside the work directory, which the run starts afresh
    objective = {"type": "grpo", "num_generations": G, "max_completion_length": COMPLETION, "temperature": 1.0,
                 "rewards": [{"function": str(WORK / "rewards.py") + ":length"}]}  # fmt: skip
    res = measure_mega_train(setup, tokens, work, model={"init": str(ckpt)}, precision=precision,
                             objective=objective, optimizer={"lr": 1e-6, "warmup_steps": 0})  # fmt: skip
    if "error" in res:
        return res
    seconds = sum(r["step_time_s"] for r in res.pop("records"))
    return {"steps_per_s": setup.timed / seconds, "rss": res["rss"]}


def measure_rounds(
    setup: Setup, prompts: Path, tokens: Path, rows: Path, hf: Path, ckpt: Path, precision: str
) -> dict:
    tok = hf_tokenizer(train_data().tokenizer, WORK / "hf-tokenizer")

    def measure(kind: str, r: int) -> dict:
        work = WORK / "work" / f"{kind}-{r}"
        if kind == "mega":
            return measure_ours(setup, tokens, ckpt, work, precision)
        return measure_child(Path(__file__), kind, setup, rows, work, hf=str(hf), precision=precision,
                             prompts=str(prompts), tokenizer=str(tok))  # fmt: skip

    return paired_rounds(("mega", "trl"), setup.rounds, measure, log=logger("grpo"))


def rows_of(results: dict[str, list[dict]], note: str) -> list[Row]:
    metric, target = "GRPO step steps/s, mega-train vs TRL GRPOTrainer", ">= 1.5x"
    if failed := failure(results):
        side, error = failed
        why = f"{'mega-train' if side == 'mega' else 'TRL'} failed: {error}"
        return [Row("grpo", metric, "-", "-", None, target, why, False if side == "mega" else None)]
    ours, theirs = ([r["steps_per_s"] for r in results[k]] for k in ("mega", "trl"))
    ratio, rounds = median_ratio(ours, theirs), rounds_note(ours, theirs, 3)
    return [Row("grpo", metric, f"{max(ours):.3f}", f"{max(theirs):.3f}", ratio, target, f"{note}; {rounds}")]


def run(quick: bool, rounds: int = ROUNDS) -> list[Row]:
    base = LLAMA_TINY if quick else LLAMA_125M
    setup = replace(base, micro=1, accum=2, seq=SEQ, rounds=1 if quick else rounds,
                    warmup=1, timed=2)  # fmt: skip
    precision = cpu_precision()
    _, rows, vocab = prepare_data(setup)  # the corpus and tokenizer
    setup = replace(setup, vocab=vocab)
    WORK.mkdir(parents=True, exist_ok=True)
    hf, ckpt = lora_base(setup)
    prompts = prompts_jsonl(setup)
    tokens = WORK / f"tokens-{prompts.stem}"
    tokenize(prompts, tokens, train_data().tokenizer, "--format", "prompts", "--prepend-bos")
    note = (
        f"{'quick: tiny Llama' if quick else '125M Llama'}, {setup.global_batch} prompts x {G} completions a step "
        f"of up to {COMPLETION} tokens, full fine-tuning, {precision}, {THREADS} threads, {setup.timed} timed steps"
    )
    return rows_of(measure_rounds(setup, prompts, tokens, rows, hf, ckpt, precision), note)


if __name__ == "__main__":
    main(run, {"trl": child_trl})
