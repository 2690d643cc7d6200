"""Training throughput (tokens/s) of a whole training run against the trainers people use instead.

One process, 2 threads, bf16 compute with fp32 master weights where the CPU multiplies bf16
(benchlib's `cpu_precision`; elsewhere fp32 on every side, 1 warm-up and 3 timed steps), AdamW,
the same Llama for every configuration (full size: hidden 768, 12 layers, 12 heads, 4 kv heads,
ffn 2048, the tokenizer's vocab (32000), about 125M parameters; `--quick`: 2 layers, hidden 128,
seq 128), the same batch (micro batch 4 x 2 accumulation = 8 sequences of 512 tokens per step;
and, for mega-train, the bare step and the Trainer, micro batch 4 without accumulation) and the
same data (benchlib's `prepare_data`): token ids that `mega-tokenize` wrote from the Python
standard library's sources (the Mistral tokenizer in ../shared/assets, else a 1k SentencePiece
trained here), cut into rows of seq + 1 tokens.

Configurations, each run in its own fresh subprocess (OMP_NUM_THREADS=2 and torch.set_num_threads(2)),
2 warm-up optimizer steps, then 6 timed steps (`--quick`: 1 and 2); tokens/s = timed steps x 8 x seq /
their wall time (from the end of the last warm-up step to the end of the last step):
- bare: megacore's `ParallelModel` (a 1-process gloo group, precision bf16: bf16 compute copies of
  fp32 master weights): the copies' refresh, one `forward_backward` per step over its accum micro
  batches, clipping at 1.0 (`clip_grad_norm`), fused torch AdamW step, zero_grad, under the
  trainer's allocator setting (mega_train/allocator.py), each phase timed (the "where a step's
  time goes" row: each phase's median over the timed steps). No scheduler, logging or data
  pipeline: the floor of a trainer built on this engine.
- hf: transformers' `Trainer` on `LlamaForCausalLM` (random init, SDPA attention), `bf16=True`
  (autocast), `use_cpu=True`, its default optimizer (fused torch AdamW), a cosine schedule (as
  mega-train's), otherwise its defaults (clipping at 1.0, progress bar); no eval or saving,
  report_to none, 0 dataloader workers. Steps timed by a `TrainerCallback` two ways: wall time
  between on_step_end calls (what the tokens/s rows use: everything the loop does), and the sum of
  on_step_begin -> on_step_end (the "callbacks" rows: leaves out the loop's work between steps,
  fetching and counting the next batch and logging, as a user timing the Trainer with its own
  callbacks measures it).
- litgpt: litgpt's `pretrain` (its own loop, which torch.compiles the whole model; foreach AdamW on
  CPU, clipping at 1.0, cosine schedule, a csv logger, logging every step) on the equivalent litgpt
  `Config`, precision "bf16-mixed" (autocast, fp32 weights), the same rows through a `DataModule`.
  Step ends are the times its loop fetches the next micro batch (a collate function records them).
  The final checkpoint save is skipped (it comes after the timed steps).
- mega-train: `mega-train --manifest run.json` (recompute none), tokens/s = the timed steps' tokens /
  the sum of the `step_time_s` it logs in metrics.jsonl for the steps after the warm-up ones. Also run
  once each with recompute selective and full, for their peak RSS; and once per round with
  `"compile": true` (every block torch.compiled), against litgpt, which compiles too.
Rows: mega-train against each of the others, its peak RSS per recompute mode, and the bare engine
step against the peers (the engine's floor). Against litgpt, which compiles its model, the target is
on the like-for-like row (both compiled); mega-train eager against it is shown without a target.
Peak RSS of every configuration is that one child's own (benchlib's `launch`: `ru_maxrss` of the
rusage `os.wait4` returns for it, read by a small launcher process), nothing else this process ran.

The peers need packages the main venv does not have: accelerate for the Trainer; litgpt, which
pins huggingface_hub < 1.4, with which the main venv's transformers 5 does not import (torchmetrics,
under lightning, imports transformers), so its venv also gets transformers 4. Each gets a throwaway
venv under bench-out/train/, made on the first run: a plain venv whose .pth adds the main venv's site-packages behind its own (`--system-site-packages` would
add the base interpreter's, without torch), pip-installed with torch pinned by a constraint to the
installed version, so pip can never replace torch. A peer that cannot be installed or run says why
in its row's note instead of failing the run.

Rounds are interleaved (benchlib's `paired_rounds`: every configuration once per round, each of
ours next to the peer it is compared with, the order reversed every other round), 3 rounds
(`--quick`: 1), then the two pairs with a target (mega-train and the bare step, compiled
mega-train and litgpt) alone, alternating which goes first, up to PAIR_ROUNDS (6) rounds: the
targets' margins are within the noise of 3. Tokens/s shown are each configuration's best round;
ratios are the median over the rounds both sides ran of ours / peer in the same round (this 2-core
machine is shared and its speed drifts).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from benchlib import (
    THREADS,
    TRAIN_OUT,
    Setup,
    child_main,
    cpu_precision,
    cpu_setup,
    failure,
    gb,
    hf_llama,
    last_line,
    load_rows,
    logger,
    measure_child,
    measure_mega_train,
    median_ratio,
    ours_config,
    paired_rounds,
    prepare_data,
    rounds_note,
    tokens_per_s,
    trainer_feed,
)
from run import Row

OUT = TRAIN_OUT
RECOMPUTE = ("selective", "full")  # besides none, run once each for their peak RSS
PEER_VENVS = {  # name -> what pip installs there (torch pinned by a constraint)
    "hf": ["accelerate"],
    "litgpt": ["litgpt", "transformers<5"],
}
NO_ACCUM = {"accum": 1}  # and as many timed tokens as LLAMA_125M's: accum x its timed steps
NO_ACCUM_KINDS = ("bare", "mega", "hf")
log = logger("train")


# --- peer venvs ----------------------------------------------------------------------------------


def peer_python(name: str) -> Path | str:
    """The python of the throwaway venv of peer `name`, made and installed on first use, or why
    it could not be made (a line of pip's error)."""
    import torch

    venv = OUT / f"venv-{name}"
    python, done = venv / "bin" / "python", venv / "installed.json"
    want = {"packages": PEER_VENVS[name], "torch": torch.__version__}
    if done.is_file() and json.loads(done.read_text()) == want:
        return python
    log(f"making the {name} venv in {venv} (pip install {' '.join(PEER_VENVS[name])}) ...")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    main_site = Path(torch.__file__).parents[1]
    (site / "main-venv.pth").write_text(f"import site; site.addsitedir({str(main_site)!r})\n")
    constraint = venv / "constraints.txt"
    constraint.write_text(f"torch=={torch.__version__}\n")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", constraint, *PEER_VENVS[name]],
        capture_output=True,
        text=True,
    )
    if pip.returncode:
        return f"pip install {' '.join(PEER_VENVS[name])} failed: {last_line(pip.stderr)}"
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True
    )
    if probe.stdout.strip() != torch.__file__:
        return f"the {name} venv does not use the main venv's torch: {probe.stdout.strip() or probe.stderr}"
    done.write_text(json.dumps(want))
    return python


# --- the children: one configuration each, run as `bench_train.py --child KIND SPEC` -------------


# The bare step's phases, in order: the compute copies' refresh (bf16 casts of the fp32 weights),
# forward and backward over the accum microbatches, clipping, AdamW's step with zero_grad.
PHASES = ("copies", "forward+backward", "clip", "adamw")


def child_bare(setup: Setup, spec: dict) -> dict:
    import torch

    from mega_train.allocator import configure_allocator
    from megacore.config import ModelConfig
    from megacore.parallel.clip import clip_grad_norm
    from megacore.parallel.engine import ParallelModel
    from megacore.parallel.layout import Parallelism
    from megacore.parallel.mesh import build_mesh, shutdown

    # The trainer's process-wide allocator setting too, so that the overhead row measures the loop.
    trim = configure_allocator("cpu")
    rows = load_rows(spec)
    torch.manual_seed(0)
    par = Parallelism(precision=spec.get("precision", "bf16"), microbatches=setup.accum)
    model = ParallelModel(ModelConfig(**ours_config(setup)), par, build_mesh(), "cpu")
    model.before_microbatch = trim
    model.init_weights()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, fused=True)
    ends, phases = [], {k: [] for k in PHASES}
    for step in range(setup.steps):
        batch = rows[step * setup.global_batch :][: setup.global_batch]
        t = [time.perf_counter()]
        for copies in model.copies:  # what forward_backward does first, timed apart
            copies.refresh()
        t.append(time.perf_counter())
        model.forward_backward(batch[:, :-1], batch[:, 1:])  # accum microbatches of setup.micro
        t.append(time.perf_counter())
        clip_grad_norm(params, 1.0)
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        ends.append(t[-1])
        for k, a, b in zip(PHASES, t[:-1], t[1:], strict=True):
            phases[k].append(b - a)
    shutdown()
    timed = {k: statistics.median(v[setup.warmup :]) for k, v in phases.items()}
    return {
        "tokens_per_s": tokens_per_s(setup, ends),
        "params": sum(p.numel() for p in params),
        "phases": timed,
    }


def child_hf(setup: Setup, spec: dict) -> dict:
    from transformers import Trainer, TrainingArguments

    dataset, callback = trainer_feed(setup, spec)
    model = hf_llama(setup)
    args = TrainingArguments(
        output_dir=spec["work"], max_steps=setup.steps, per_device_train_batch_size=setup.micro,
        gradient_accumulation_steps=setup.accum, learning_rate=3e-4, bf16=spec.get("precision", "bf16") == "bf16",
        use_cpu=True,
        report_to="none", dataloader_num_workers=0, save_strategy="no", eval_strategy="no", seed=0,
        lr_scheduler_type="cosine",
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
    params = sum(p.numel() for p in model.parameters())
    spans = setup.timed_tokens / sum(callback.spans[setup.warmup :])
    return {"tokens_per_s": tokens_per_s(setup, callback.ends), "params": params, "optim": args.optim,
            "tokens_per_s_callbacks": spans}  # fmt: skip


def child_litgpt(setup: Setup, spec: dict) -> dict:
    import torch
    from litgpt import pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule

    rows = load_rows(spec)
    fetches: list[float] = []  # when the loop took each training micro batch

    def collate(items: list[torch.Tensor]) -> torch.Tensor:
        fetches.append(time.perf_counter())
        return torch.stack(items)

    class Rows(DataModule):
        def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
            self.batch_size = batch_size

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(rows), batch_size=self.batch_size, collate_fn=collate)

        def val_dataloader(self):  # its sanity check before training: 2 batches
            return torch.utils.data.DataLoader(list(rows), batch_size=self.batch_size)

    config = Config(
        name="bench-llama", block_size=setup.seq, vocab_size=setup.vocab, padded_vocab_size=setup.vocab,
        n_layer=setup.layers, n_head=setup.heads, n_embd=setup.hidden, n_query_groups=setup.kv_heads,
        rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-5,
        mlp_class_name="LLaMAMLP", intermediate_size=setup.ffn, rope_base=10000,
    )  # fmt: skip
    train = TrainArgs(
        save_interval=None, log_interval=1, global_batch_size=setup.global_batch, micro_batch_size=setup.micro,
        max_tokens=setup.steps * setup.global_batch * setup.seq, max_seq_length=setup.seq, lr_warmup_steps=0,
        max_norm=1.0, min_lr=3e-5, tie_embeddings=False,
    )  # fmt: skip
    evaluation = EvalArgs(interval=10**9, max_iters=1, initial_validation=False, final_validation=False)
    params = []
    pretrain.save_checkpoint = lambda fabric, state, *_: params.append(  # after the timed steps: skipped
        sum(p.numel() for p in state["model"].parameters())
    )
    pretrain.setup(
        "bench-llama", model_config=config, out_dir=Path(spec["work"]) / "out", precision=LITGPT[spec["precision"]],
        data=Rows(), train=train, eval=evaluation, optimizer="AdamW", devices=1, logger_name="csv", seed=0,
    )  # fmt: skip
    # Micro batch i is fetched when micro batch i - 1 is done; step k ends when micro batch k * accum
    # is fetched (after the last step the loop fetches once more, then stops).
    ends = fetches[setup.accum :: setup.accum]
    return {
        "tokens_per_s": tokens_per_s(setup, ends),
        "params": params[0],
        "precision": LITGPT[spec["precision"]],
    }


CHILDREN = {"bare": child_bare, "hf": child_hf, "litgpt": child_litgpt}
LITGPT = {"bf16": "bf16-mixed", "fp32": "32-true"}  # litgpt's names of the precisions


# --- the benchmark -------------------------------------------------------------------------------


LABELS = {
    "bare": "bare engine step",
    "hf": "HF Trainer",
    "litgpt": "litgpt pretrain",
    "mega": "mega-train",
    "mega-compiled": 'mega-train "compile": true',
}


OURS = (
    "bare",
    "mega",
    "mega-compiled",
)  # a failure of ours fails the run; a peer's failure is only its row's note


def compare(
    results: dict[str, list[dict]], ours: str, peer: str, target: str, note: str, suffix: str = "",
    peer_key: str = "tokens_per_s",
) -> Row:  # fmt: skip
    """A tokens/s row: best round of each side; ratio: median over rounds of ours / peer (the
    peer's `peer_key` figure). `suffix`: what sets the row apart (no accumulation, the timing)."""
    metric = f"tokens/s, {LABELS[ours]} vs {LABELS[peer]}{suffix}"
    if failed := failure(results, (ours, peer)):
        side, why = failed
        passed = False if side in OURS else None
        return Row("train", metric, "-", "-", None, target, f"{LABELS[side]} failed: {why}", passed)
    o = [r["tokens_per_s"] for r in results[ours]]
    p = [r[peer_key] for r in results[peer]]
    n = min(len(o), len(p))  # the rounds both ran (the pairs with a target run PAIR_ROUNDS)
    o, p = o[:n], p[:n]
    ratio, rounds = median_ratio(o, p), rounds_note(o, p)
    rss = f"peak RSS {gb(max(r['rss'] for r in results[ours]))} vs {gb(max(r['rss'] for r in results[peer]))}"
    return Row("train", metric, f"{max(o):.0f}", f"{max(p):.0f}", ratio, target, f"{note}; {rounds}; {rss}")


def rss_row(setup: Setup, tokens: Path, results: dict[str, list[dict]], note: str) -> Row:
    """Peak RSS of mega-train with recompute none / selective / full (none: its first timed round;
    the other two run side by side after the timed rounds, warm-up + 1 step: only memory is read),
    against the HF Trainer's; ratio: Trainer / ours with recompute none."""
    metric = "peak RSS, mega-train recompute none/selective/full vs HF Trainer"
    if "error" in results["mega"][0]:
        return Row(
            "train",
            metric,
            "-",
            "-",
            None,
            note=f"mega-train failed: {results['mega'][0]['error']}",
            passed=False,
        )
    short = replace(setup, timed=1)
    with ThreadPoolExecutor(2) as pool:
        others = pool.map(
            lambda rc: measure_mega_train(short, tokens, OUT / "work" / f"mega-{rc}", rc), RECOMPUTE
        )
        runs = [results["mega"][0], *others]
    failed = [
        f"recompute {rc}: {r['error']}"
        for rc, r in zip(("none", *RECOMPUTE), runs, strict=True)
        if "error" in r
    ]
    if failed:
        return Row("train", metric, "-", "-", None, note=f"mega-train failed: {failed[0]}", passed=False)
    ours = "/".join(f"{r['rss'] / 1e9:.2f}" for r in runs) + " GB"
    hf = [r["rss"] for r in results["hf"] if "error" not in r]
    if not hf:
        return Row("train", metric, ours, "-", None, note=f"{note}; HF Trainer failed")
    return Row("train", metric, ours, gb(max(hf)), max(hf) / runs[0]["rss"], note=note)


# The order of a round: each of ours runs next to the peer it is compared with (mega-train between
# the bare step and the HF Trainer, the compiled run next to litgpt), as this machine's speed drifts
# from minute to minute.
ORDER = ("bare", "mega", "hf", "litgpt", "mega-compiled")


# The targets' margins are within this machine's round-to-round noise (mega-train against the bare
# step: paired ratios 0.92, 1.02, 0.91 in one run; compiled against litgpt: 1.09, 1.21, 1.46 in
# another): the two pairs with a target run PAIR_ROUNDS rounds, the rest 3.
PAIR_ROUNDS = 6
PAIRED = ("bare", "mega", "litgpt", "mega-compiled")


def measure_rounds(
    setup: Setup, tokens: Path, rows: Path, kinds: tuple[str, ...] = ORDER, paired: tuple[str, ...] = PAIRED
) -> dict[str, list[dict]]:
    """Every configuration of `kinds` once per round, in ORDER, reversed every other round (so no
    configuration always runs first); then the pairs with a target alone, alternating, up to
    PAIR_ROUNDS."""
    kinds = tuple(k for k in ORDER if k in kinds)
    pythons = {"bare": Path(sys.executable)} | {k: peer_python(k) for k in PEER_VENVS if k in kinds}
    pairs = max(setup.rounds, PAIR_ROUNDS if setup.rounds > 1 and paired else 1)
    tag = "" if setup.accum > 1 else "-noaccum"

    def measure(kind: str, r: int) -> dict:
        work = OUT / "work" / f"{kind}{tag}-{r}"
        if kind.startswith("mega"):
            return measure_mega_train(setup, tokens, work, compile=kind == "mega-compiled")
        if isinstance(pythons[kind], str):  # its venv could not be made
            return {"error": pythons[kind]}
        return measure_child(Path(__file__), kind, setup, rows, work, python=pythons[kind])

    say = logger(f"train{tag}")
    results = paired_rounds(kinds, setup.rounds, measure, log=say)
    more = paired_rounds(paired, pairs - setup.rounds, measure, first=setup.rounds, log=say)
    return {k: v + more.get(k, []) for k, v in results.items()}


def phase_row(accumulated: dict[str, list[dict]], single: dict[str, list[dict]]) -> Row:
    """Where the bare step's time goes, with and without accumulation: each phase's seconds (the
    median over its rounds of each round's median step) and its share of the step."""
    parts = []
    for name, results in (("accumulation 2", accumulated), ("no accumulation", single)):
        runs = [r["phases"] for r in results.get("bare", []) if "phases" in r]
        if not runs:
            continue
        phases = {k: statistics.median(r[k] for r in runs) for k in PHASES}
        total = sum(phases.values())
        shares = ", ".join(f"{k} {v:.2f}s ({100 * v / total:.0f}%)" for k, v in phases.items())
        parts.append(f"{name}: {shares}")
    return Row(
        "train", "where a bare step's time goes", "-", "-", None, note="; ".join(parts) or "bare failed"
    )


def note_of(setup: Setup, quick: bool) -> str:
    """The rows' note: the model, the batch, the precision, the threads, the timed steps."""
    precision = cpu_precision()
    why = " (this CPU has no bf16 matmul: AMX or AVX512-BF16)" if precision == "fp32" else ""
    return (
        f"{'quick: tiny Llama' if quick else '125M Llama'}, {setup.micro}x{setup.accum}x{setup.seq} tokens/step, "
        f"{precision}{why}, {THREADS} threads, {setup.timed} timed steps"
    )


def check(rounds: int) -> list[Row]:
    """The guarded row (bench/check.py): mega-train against the Trainer with accumulation, in
    `rounds` paired rounds and nothing else."""
    setup = cpu_setup(False, rounds)
    tokens, rows, vocab = prepare_data(setup)
    setup = replace(setup, vocab=vocab)
    results = measure_rounds(setup, tokens, rows, ("mega", "hf"), ())
    return [compare(results, "mega", "hf", ">= 1.3x", note_of(setup, False))]


def run(quick: bool, peers: tuple[str, ...] = ORDER) -> list[Row]:
    """Every configuration with accumulation (LLAMA_125M), and mega-train, the bare step and the
    Trainer without (NO_ACCUM); `peers`: a subset of ORDER (`--trainer-only`: the Trainer's rows)."""
    tokens, rows, vocab = prepare_data(cpu_setup(quick))
    setup = replace(cpu_setup(quick), vocab=vocab)
    single = replace(setup, **NO_ACCUM, timed=setup.timed * setup.accum)
    paired = tuple(k for k in PAIRED if k in peers)
    results = measure_rounds(setup, tokens, rows, peers, paired)
    _, single_rows, _ = prepare_data(single)
    no_accum = measure_rounds(single, tokens, single_rows, tuple(k for k in NO_ACCUM_KINDS if k in peers), ())
    note = note_of(setup, quick)
    params = {k: v[0]["params"] for k, v in results.items() if v and "params" in v[0]}
    if len(set(params.values())) > 1:
        note += f"; parameter counts differ: {params}"
    single_note = f"{note.replace(f'x{setup.accum}x', 'x1x')}; no accumulation ({single.timed} timed steps)"
    lit = f"litgpt: {LITGPT[cpu_precision()]}, its pretrain torch.compiles the model"
    out = []
    if "bare" in peers:
        out.append(
            compare(
                results, "mega", "bare", ">= 0.95x (< 5% overhead)", f"{note}; mega-train: its step_time_s"
            )
        )
    if "hf" in peers:
        callbacks = "; the Trainer timed by its callbacks, on_step_begin -> on_step_end"
        out += [
            compare(results, "mega", "hf", ">= 1.3x", note),
            compare(no_accum, "mega", "hf", ">= 1.3x", single_note, ", no accumulation"),
            compare(results, "mega", "hf", "", note + callbacks, " (callbacks)", "tokens_per_s_callbacks"),
            compare(
                no_accum,
                "mega",
                "hf",
                "",
                single_note + callbacks,
                ", no accumulation (callbacks)",
                "tokens_per_s_callbacks",
            ),
        ]
    if "litgpt" in peers:
        # litgpt compiles its model: the like-for-like row is the compiled one; this one is shown.
        out.append(compare(results, "mega", "litgpt", "", f"{note}; {lit}; mega-train eager"))
        out.append(compare(results, "mega-compiled", "litgpt", ">= 1.3x", f"{note}; {lit}; both compile"))
    if "hf" in peers:
        out.append(rss_row(setup, tokens, results, note))
    if "bare" in peers:
        if "hf" in peers:
            out.append(compare(results, "bare", "hf", "", note))
        if "litgpt" in peers:
            out.append(compare(results, "bare", "litgpt", "", f"{note}; {lit}"))
        out.append(phase_row(results, no_accum))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2], sys.argv[3], CHILDREN)
    else:
        from run import table

        # --trainer-only: mega-train, the bare step and the HF Trainer (no litgpt, nothing compiled).
        peers = ("bare", "mega", "hf") if "--trainer-only" in sys.argv else ORDER
        print(table(run("--quick" in sys.argv, peers)))
