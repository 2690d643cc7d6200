"""Training throughput (tokens/s) of a whole training run against the trainers people use instead.

One process, 2 threads, bf16 compute with fp32 master weights where the CPU multiplies bf16
(`cpu_precision`; elsewhere fp32 on every side, 1 warm-up and 3 timed steps), AdamW, the same Llama for every
configuration (full size: hidden 768, 12 layers, 12 heads, 4 kv heads, ffn 2048, the tokenizer's
vocab (32000), about 125M parameters; `--quick`: 2 layers, hidden 128, seq 128), the same batch
(micro batch 4 x 2 accumulation = 8 sequences of 512 tokens per step; and, for mega-train, the
bare step and the Trainer, micro batch 4 without accumulation) and the same data: token ids
that `mega-tokenize` wrote from the Python standard library's sources (the Mistral tokenizer in
../shared/assets, else a 1k SentencePiece trained here), cut into rows of seq + 1 tokens.

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
Peak RSS of every configuration is `ru_maxrss` of the rusage `os.wait4` returns for that one child:
its own peak (or that of a process it started and waited for, if larger; not a sum), nothing else
this process ran, so no helper process is needed.

The peers need packages the main venv does not have: accelerate for the Trainer; litgpt, which
pins huggingface_hub < 1.4, with which the main venv's transformers 5 does not import (torchmetrics,
under lightning, imports transformers), so its venv also gets transformers 4. Each gets a throwaway
venv under bench-out/train/, made on the first run: a plain venv whose .pth adds the main venv's site-packages behind its own (`--system-site-packages` would
add the base interpreter's, without torch), pip-installed with torch pinned by a constraint to the
installed version, so pip can never replace torch. A peer that cannot be installed or run says why
in its row's note instead of failing the run.

Rounds are interleaved (every configuration once per round, each of ours next to the peer it is
compared with, the order reversed every other round), 3 rounds (`--quick`: 1), then the two pairs
with a target (mega-train and the bare step, compiled mega-train and litgpt) alone, alternating
which goes first, up to PAIR_ROUNDS (6) rounds: the targets' margins are within the noise of 3. Tokens/s shown are each configuration's best
round; ratios are the median over the rounds both sides ran of ours / peer in the same round (this
2-core machine is shared and its speed drifts).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from run import Row

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out" / "train"
BIN = Path(sys.executable).parent
SHARED_TOKENIZER = ROOT.parent / "shared" / "assets" / "mistral-v1-tokenizer.model"
THREADS = 2
CHILD_TIMEOUT = 1800  # seconds; a configuration taking longer is killed and its row says so
RECOMPUTE = ("selective", "full")  # besides none, run once each for their peak RSS
PEER_VENVS = {  # name -> what pip installs there (torch pinned by a constraint)
    "hf": ["accelerate"],
    "litgpt": ["litgpt", "transformers<5"],
}


@dataclass(frozen=True)
class Setup:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    micro: int = 4
    accum: int = 2
    warmup: int = 2
    timed: int = 6
    rounds: int = 3
    vocab: int = 0  # the tokenizer's, filled in once it is known

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum

    @property
    def steps(self) -> int:
        return self.warmup + self.timed

    @property
    def timed_tokens(self) -> int:
        return self.timed * self.global_batch * self.seq


FULL = Setup(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, seq=512)
QUICK = Setup(hidden=128, layers=2, heads=4, kv_heads=2, ffn=384, seq=128, warmup=1, timed=2, rounds=1)
NO_ACCUM = {"accum": 1}  # and as many timed tokens as FULL's: accum x its timed steps
NO_ACCUM_KINDS = ("bare", "mega", "hf")


def log(msg: str) -> None:
    print(f"   train: {msg}", file=sys.stderr, flush=True)


def cpu_precision() -> str:
    """bf16 where this CPU multiplies bf16 in hardware (AMX or AVX512-BF16), else fp32: without
    either, torch's bf16 matmuls take a fallback 6-200x slower than fp32's (measured on an AVX2
    EPYC, 2 threads: 17 and 0.5 GFLOP/s against 115 for 2048 x 768 by 768 x 2048), which would
    measure that fallback, not the trainers. Every CPU benchmark against a peer runs both sides
    in it, and says which."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    return "bf16" if "amx_bf16" in flags or "avx512_bf16" in flags else "fp32"


# --- data ----------------------------------------------------------------------------------------


def corpus(path: Path, size: int = 2 << 20) -> Path:
    """About `size` bytes of real text as jsonl: the standard library's .py files, one per document."""
    if path.exists():
        return path
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines, total = [], 0
    for f in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts):
        text = f.read_text(errors="replace")
        lines.append(json.dumps({"text": text}) + "\n")
        total += len(text)
        if total >= size:
            break
    path.write_text("".join(lines))
    return path


def tokenizer(out: Path, corpus_path: Path) -> Path:
    """The real Mistral tokenizer when ../shared has it, else a 1k SentencePiece trained here."""
    if SHARED_TOKENIZER.is_file():
        return SHARED_TOKENIZER
    model = out / "tokenizer.model"
    if not model.exists():
        import io

        import sentencepiece as spm

        texts = [json.loads(line)["text"] for line in corpus_path.read_text().splitlines()]
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=buf, vocab_size=1000, model_type="bpe",
            byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
        )  # fmt: skip
        model.write_bytes(buf.getvalue())
    return model


def prepare_data(setup: Setup) -> tuple[Path, Path, int]:
    """The tokens artifact (for mega-train), the rows every other configuration reads (an int64
    .npy of steps x global batch rows of seq + 1 tokens, from the start of the same tokens) and
    the vocab size."""
    import numpy as np

    from megacore.data.indexed import IndexedReader

    OUT.mkdir(parents=True, exist_ok=True)
    text = corpus(OUT / "corpus.jsonl")
    tokens = OUT / "tokens"
    subprocess.run(
        [BIN / "mega-tokenize", text, tokens, "--tokenizer", tokenizer(OUT, text), "--workers", str(THREADS),
         "--no-progress"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    vocab = json.loads((tokens / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    stream = np.concatenate(
        [IndexedReader(p.with_suffix("")).tokens for p in sorted(tokens.glob("shards/*.idx"))]
    )
    n = setup.steps * setup.global_batch
    if len(stream) < n * (setup.seq + 1):
        raise RuntimeError(f"{len(stream)} tokens in {tokens}, need {n * (setup.seq + 1)}")
    rows = OUT / f"rows-{n}x{setup.seq + 1}.npy"
    np.save(rows, stream[: n * (setup.seq + 1)].astype(np.int64).reshape(n, setup.seq + 1))
    return tokens, rows, vocab


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


def last_line(text: str, width: int = 160) -> str:
    """The last meaningful line of an error output, shortened: what a note quotes."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("WARNING", "  "))]
    line = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return line if len(line) <= width else line[: width - 3] + "..."


# --- running one configuration -------------------------------------------------------------------


def launch(cmd: list, log_path: Path, env: dict[str, str], cwd: Path) -> tuple[int, int]:
    """Run `cmd` (output to `log_path`); returns (exit code, the child's peak RSS in bytes).

    The peak RSS is ru_maxrss of the rusage `os.wait4` returns for this child alone (and any
    descendants it waited for), so nothing else this process ran is counted."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        timer = threading.Timer(CHILD_TIMEOUT, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
    return proc.returncode, usage.ru_maxrss * 1024  # kB on Linux


def child_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(
    kind: str, setup: Setup, rows: Path, python: Path, work: Path, script: Path = Path(__file__), **extra: str
) -> dict:
    """One configuration in a fresh subprocess (`script`, this file by default, with `--child KIND
    SPEC`; `extra`: more fields of SPEC): its result (tokens_per_s, params, ...) plus rss, or
    {"error": ...}."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = {"setup": asdict(setup), "rows": str(rows), "work": str(work), "result": str(work / "result.json")}
    spec |= {"precision": cpu_precision()} | extra
    (work / "spec.json").write_text(json.dumps(spec))
    env = child_env()
    # A 1-process torch.distributed group for the engine (what torchrun would set).
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    rc, rss = launch([python, script, "--child", kind, work / "spec.json"], work / "log.txt", env, work)
    result_path = Path(spec["result"])
    if rc or not result_path.is_file():
        return {"error": f"exit {rc}: {last_line((work / 'log.txt').read_text(errors='replace'))}"}
    return {**json.loads(result_path.read_text()), "rss": rss}


def mega_manifest(setup: Setup, tokens: Path, out: Path, recompute: str, compile: bool, **extra) -> dict:
    return {
        "kind": "run", "format_version": 1, "out": str(out),
        "model": {"config": ours_config(setup)},
        "data": {"sources": [{"path": str(tokens)}], "split": [1, 0]},
        "batch": {"micro_batch_size": setup.micro, "global_batch_size": setup.global_batch, "seq_length": setup.seq},
        "train_steps": setup.steps, "precision": cpu_precision(), "recompute": recompute, "compile": compile,
        "optimizer": {"lr": 3e-4, "warmup_steps": 0}, "logging": {"every": 1}, "checkpoint": {"every": 100000},
    } | extra  # fmt: skip


def mega_train_command() -> list:
    """The console script, or the same entry point through this python where it is not installed
    (a GPU machine with the sources on PYTHONPATH)."""
    script = BIN / "mega-train"
    return [script] if script.exists() else [sys.executable, "-c", "from mega_train.cli import main; main()"]


def measure_mega_train(
    setup: Setup, tokens: Path, work: Path, recompute: str = "none", compile: bool = False, **extra
) -> dict:
    """`mega-train --manifest run.json` as a subprocess (`extra`: more manifest fields); tokens/s
    from its metrics.jsonl (the `step_time_s` of the steps after the warm-up ones) and those steps'
    records, or {"error": ...}."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = work / "run-out"
    manifest = mega_manifest(setup, tokens, out, recompute, compile, **extra)
    (work / "run.json").write_text(json.dumps(manifest, indent=2))
    rc, rss = launch(
        [*mega_train_command(), "--manifest", work / "run.json"], work / "log.txt", child_env(), work
    )
    text = (work / "log.txt").read_text(errors="replace")
    metrics = out / "metrics.jsonl"
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # weights and AdamW state: GBs, not needed
    if rc or not metrics.is_file():
        return {"error": f"exit {rc}: {last_line(text)}"}
    steps = sorted(
        (r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"),
        key=lambda r: r["step"],
    )[setup.warmup :]
    if len(steps) < setup.timed:
        return {"error": f"{len(steps)} train steps after the warm-up in {metrics}, expected {setup.timed}"}
    return {
        "tokens_per_s": setup.timed_tokens / sum(r["step_time_s"] for r in steps),
        "rss": rss,
        "records": steps,
    }


# --- the children: one configuration each, run as `bench_train.py --child KIND SPEC` -------------


def ours_config(setup: Setup) -> dict:
    return dict(
        family="llama", vocab_size=setup.vocab, hidden_size=setup.hidden, num_layers=setup.layers,
        num_heads=setup.heads, num_kv_heads=setup.kv_heads, ffn_hidden_size=setup.ffn, max_seq_len=setup.seq,
    )  # fmt: skip


def load_rows(spec: dict):
    import numpy as np
    import torch

    torch.set_num_threads(THREADS)
    return torch.from_numpy(np.load(spec["rows"]))


def tokens_per_s(setup: Setup, step_ends: list[float]) -> float:
    """Timed tokens over the wall time from the end of the last warm-up step to the end of the last."""
    if len(step_ends) != setup.steps:
        raise RuntimeError(f"{len(step_ends)} step ends recorded, expected {setup.steps}")
    times = [round(b - a, 2) for a, b in itertools.pairwise(step_ends)]
    print(f"bench_train: step times after the first: {times}", file=sys.stderr, flush=True)  # in log.txt
    return setup.timed_tokens / (step_ends[-1] - step_ends[setup.warmup - 1])


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


def trainer_feed(setup: Setup, spec: dict) -> tuple:
    """What the Trainer configurations are given: a dataset of the rows (input and labels alike:
    the model shifts the labels itself) and a callback recording each step's end and its span from
    on_step_begin (`ends`, `spans`)."""
    import torch
    from transformers import TrainerCallback

    rows = load_rows(spec)

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": rows[i, : setup.seq], "labels": rows[i, : setup.seq]}

    class StepEnds(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.spans: list[float] = []  # on_step_begin -> on_step_end

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.spans.append(self.ends[-1] - self.begin)

    return Rows(), StepEnds()


def hf_llama(setup: Setup):
    """transformers' LlamaForCausalLM of the setup's shape, random weights (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=setup.ffn,
        num_hidden_layers=setup.layers, num_attention_heads=setup.heads, num_key_value_heads=setup.kv_heads,
        max_position_embeddings=setup.seq, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


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


def child_main(kind: str, spec_path: str, children: dict | None = None) -> None:
    """Run child `kind` (of `children`, else this file's) on its spec; its result into the spec's file."""
    spec = json.loads(Path(spec_path).read_text())
    result = (children or CHILDREN)[kind](Setup(**spec["setup"]), spec)
    Path(spec["result"]).write_text(json.dumps(result))


# --- the benchmark -------------------------------------------------------------------------------


LABELS = {
    "bare": "bare engine step",
    "hf": "HF Trainer",
    "litgpt": "litgpt pretrain",
    "mega": "mega-train",
    "mega-compiled": 'mega-train "compile": true',
}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


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
    for side in (ours, peer):
        failed = [r["error"] for r in results[side] if "error" in r]
        if failed:
            passed = False if side in OURS else None
            return Row("train", metric, "-", "-", None, target, f"{LABELS[side]} failed: {failed[0]}", passed)
    o = [r["tokens_per_s"] for r in results[ours]]
    p = [r[peer_key] for r in results[peer]]
    n = min(len(o), len(p))  # the rounds both ran (the pairs with a target run PAIR_ROUNDS)
    o, p = o[:n], p[:n]
    ratio = statistics.median(a / b for a, b in zip(o, p, strict=True))
    rounds = f"rounds {'/'.join(f'{x:.0f}' for x in o)} vs {'/'.join(f'{x:.0f}' for x in p)}"
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
    short = Setup(**{**asdict(setup), "timed": 1})
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
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    pairs = max(setup.rounds, PAIR_ROUNDS if setup.rounds > 1 and paired else 1)
    tag = "" if setup.accum > 1 else "-noaccum"
    for r in range(pairs):
        order = kinds if r < setup.rounds else paired
        for kind in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            if kind.startswith("mega"):
                compiled = kind == "mega-compiled"
                res = measure_mega_train(setup, tokens, OUT / "work" / f"{kind}{tag}-{r}", compile=compiled)
            elif isinstance(pythons[kind], str):  # its venv could not be made
                res = {"error": pythons[kind]}
            else:
                res = measure(kind, setup, rows, pythons[kind], OUT / "work" / f"{kind}{tag}-{r}")
            results[kind].append(res)
            shown = {k: v for k, v in res.items() if k not in ("rss", "records")}
            log(f"round {r + 1}/{pairs} {kind}{tag}: {shown} ({time.perf_counter() - t:.0f}s)")
    return results


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


def sized(quick: bool, rounds: int | None = None) -> Setup:
    """QUICK or FULL (`rounds` of it), and in fp32 (`cpu_precision`) FULL's steps cut to 1 warm-up
    and 3 timed: an fp32 step takes several times a bf16 one on a CPU that multiplies bf16."""
    setup = QUICK if quick else FULL
    if not quick and cpu_precision() == "fp32":
        setup = Setup(**{**asdict(setup), "warmup": 1, "timed": 3})
    return setup if rounds is None else Setup(**{**asdict(setup), "rounds": rounds})


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
    setup = sized(False, rounds)
    tokens, rows, vocab = prepare_data(setup)
    setup = Setup(**{**asdict(setup), "vocab": vocab})
    results = measure_rounds(setup, tokens, rows, ("mega", "hf"), ())
    return [compare(results, "mega", "hf", ">= 1.3x", note_of(setup, False))]


def run(quick: bool, peers: tuple[str, ...] = ORDER) -> list[Row]:
    """Every configuration with accumulation (FULL), and mega-train, the bare step and the Trainer
    without (NO_ACCUM); `peers`: a subset of ORDER (`--trainer-only`: the Trainer's rows)."""
    tokens, rows, vocab = prepare_data(sized(quick))
    setup = Setup(**{**asdict(sized(quick)), "vocab": vocab})
    single = Setup(**{**asdict(setup), **NO_ACCUM, "timed": setup.timed * setup.accum})
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
        child_main(sys.argv[2], sys.argv[3])
    else:
        from run import table

        # --trainer-only: mega-train, the bare step and the HF Trainer (no litgpt, nothing compiled).
        peers = ("bare", "mega", "hf") if "--trainer-only" in sys.argv else ORDER
        print(table(run("--quick" in sys.argv, peers)))
