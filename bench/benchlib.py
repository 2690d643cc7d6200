"""What the benchmarks share, each written once: every bench/bench_*.py imports this and run's `Row`,
and none imports another benchmark.

Why: this machine's speed drifts up to 2x from minute to minute, so a time measured alone says
little and one side measured after the other compares two machines. Only paired, interleaved
rounds give usable ratios: every side once a round, the order reversed every other round (or rotated)
(`paired_rounds`), the ratio the median over rounds of the two sides' figures in the same round
(`median_ratio`). With them, one corpus builder (`corpus`: real text found on this machine), one
child launcher (`launch`: a command or a Python child with its environment; its JSON result, wall
and CPU time) and one peak-memory reader (`peak_rss`, what `launch` reports: the child's own
ru_maxrss, read by a small launcher process, since a child of a benchmark's process would report
that process's peak as its own). Then what the training benchmarks share: a Llama run's `Setup`
and data, `mega-train` measured as a subprocess (`measure_mega_train`), a peer measured in a fresh
subprocess (`measure_child`, `child_main`), the Trainer's dataset and step clock; and the random
checkpoints of the checkpoint benchmarks (`write_checkpoint`)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"
# The CPU training benchmarks' data (bench_train, bench_lora, bench_dpo, bench_instruct).
TRAIN_OUT = OUT / "train"
SHARED_TOKENIZER = ROOT.parent / "shared" / "assets" / "mistral-v1-tokenizer.model"
THREADS = 2
CHILD_TIMEOUT = 1800  # seconds; a training configuration taking longer is killed and its row says so
MAX_DOC = 1 << 20  # a corpus file larger than this is split into documents at line boundaries
# mega-tokenize's threads (and the OpenMP ones of the in-process paths it is compared with).
TOKENIZE_ENV = {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": str(THREADS)}

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def logger(name: str) -> Callable[[str], None]:
    """A benchmark's progress line on stderr: `   NAME: message`."""
    return lambda msg: print(f"   {name}: {msg}", file=sys.stderr, flush=True)


def cpu_precision() -> str:
    """bf16 where this CPU multiplies bf16 in hardware (AMX or AVX512-BF16), else fp32: without
    either, torch's bf16 matmuls take a fallback 6-200x slower than fp32's (measured on an AVX2
    EPYC, 2 threads: 17 and 0.5 GFLOP/s against 115 for 2048 x 768 by 768 x 2048), which would
    measure that fallback, not the trainers. Every CPU benchmark against a peer runs both sides
    in it, and says which."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    return "bf16" if "amx_bf16" in flags or "avx512_bf16" in flags else "fp32"


# --- paired rounds -------------------------------------------------------------------------------


def paired_rounds(
    sides: Iterable[K], rounds: int, measure: Callable[[K, int], T], *, warmup: bool = False,
    rotate: bool = False, first: int = 0, log: Callable[[str], None] | None = None,
) -> dict[K, list[T]]:  # fmt: skip
    """`measure(side, r)` of every side once in each round r, `rounds` rounds from round `first` on:
    the order reversed every other round, so that drift hits every side alike and each keeps its
    neighbours (list each of ours next to the peer it is compared with); `rotate`: rotated by one
    place each round instead, so that every side takes every place. `warmup`: every side once
    before (round -1), its result dropped. Each side's results in round order; `log`: a line each."""
    sides = list(sides)
    if warmup:
        for side in sides:
            measure(side, -1)
    results: dict[K, list[T]] = {side: [] for side in sides}
    for r in range(first, first + rounds):
        for side in _order(sides, r, rotate):
            t = time.perf_counter()
            results[side].append(measure(side, r))
            if log:
                log(f"round {r + 1} {side}: {_brief(results[side][-1])} ({time.perf_counter() - t:.0f}s)")
    return results


def step_rounds(steps: dict[K, Callable[[], float]], rounds: int) -> dict[K, list[float]]:
    """`paired_rounds` of steps that time themselves (a training step: its seconds), after a warm-up
    step of each (compiling, optimizer state, oneDNN's kernel choice)."""
    return paired_rounds(steps, rounds, lambda k, _: steps[k](), warmup=True)


def _order(sides: list[K], r: int, rotate: bool) -> list[K]:
    if rotate:
        return sides[r % len(sides) :] + sides[: r % len(sides)]
    return sides[::-1] if r % 2 else sides


def _brief(result: object) -> object:
    """A result as a round's log line shows it: a dict without its bulky figures."""
    return (
        {k: v for k, v in result.items() if k not in ("rss", "records")}
        if isinstance(result, dict)
        else result
    )


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of a / b in the same round (paired rounds' ratio)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def rounds_note(a: Sequence[float], b: Sequence[float], digits: int = 0) -> str:
    """`rounds 1/2/3 vs 4/5/6`: each side's figure per round, as a row's note shows them."""
    return f"rounds {'/'.join(f'{x:.{digits}f}' for x in a)} vs {'/'.join(f'{x:.{digits}f}' for x in b)}"


def failure(results: dict[str, list[dict]], sides: Iterable[str] | None = None) -> tuple[str, str] | None:
    """The first of `sides` (default: all) with a failed round, and its error; None when all ran."""
    for side in results if sides is None else sides:
        errors = [r["error"] for r in results[side] if "error" in r]
        if errors:
            return side, errors[0]
    return None


# --- the corpus ----------------------------------------------------------------------------------


def corpus(path: Path, size: int, *, wide: bool = False) -> Path:
    """At least `size` bytes of real text as jsonl, a document a line (`{"text", "src"}`): the
    standard library's .py files, with `wide` then the files of /usr/share/doc and the .py files of
    the installed packages and of the venv; each file read as UTF-8 (one that is not, holds a NUL or
    is blank is passed over), cut at line ends into documents of at most MAX_DOC. Made once."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    written, seen = 0, set()
    with open(tmp, "w", encoding="utf-8") as f:
        for p in _text_files(wide):
            if (key := os.path.realpath(p)) in seen:
                continue
            seen.add(key)
            text = _read_text(p)
            while text:
                cut = len(text) if len(text) <= MAX_DOC else text.rfind("\n", 0, MAX_DOC) + 1 or MAX_DOC
                line = json.dumps({"text": text[:cut], "src": str(p)}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode())
                text = text[cut:]
            if written >= size:
                break
    if written < size:
        print(f"benchlib: only {written >> 20} MB of text found on this machine", file=sys.stderr)
    tmp.rename(path)
    return path


def _text_files(wide: bool) -> list[Path]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    if wide:
        files += sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and not p.is_symlink())
        files += sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
        venv = ROOT / ".venv" / "lib"
        if venv.is_dir():
            files += sorted(venv.rglob("*.py"))
    return files


def _read_text(p: Path) -> str | None:
    import gzip

    try:
        data = p.read_bytes()
        if p.suffix == ".gz":
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text if text.strip() and "\x00" not in text else None


def tokenizer(out: Path, text: Path, vocab: int = 1000) -> Path:
    """The real Mistral tokenizer when ../shared has it, else a `vocab`-piece BPE SentencePiece
    trained here (once, into `out`) on the first 200,000 non-blank lines of the corpus `text`."""
    if SHARED_TOKENIZER.is_file():
        return SHARED_TOKENIZER
    model = out / f"trained-{vocab}.model"
    if not model.is_file():
        import sentencepiece as spm

        lines: list[str] = []
        with open(text, encoding="utf-8") as f:
            for row in f:
                lines += [ln for ln in json.loads(row)["text"].splitlines() if ln.strip()]
                if len(lines) >= 200_000:
                    break
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines[:200_000]), model_prefix=str(model.with_suffix("")),
            vocab_size=vocab, model_type="bpe", byte_fallback=True, minloglevel=2,
        )  # fmt: skip
    return model


@dataclass(frozen=True)
class Text:
    """mega-tokenize's artifact (`tokens`, its tokenizer's `vocab`) of `size` bytes of corpus in `out`;
    the corpus and its tokenizer made on first use (a machine given the tokens ready made needs neither)."""

    out: Path
    size: int
    tokens: Path
    vocab: int

    @property
    def corpus(self) -> Path:
        return corpus(self.out / "corpus.jsonl", self.size)

    @property
    def tokenizer(self) -> Path:
        return tokenizer(self.out, self.corpus)


def text_data(out: Path, size: int, workers: int | None = THREADS) -> Text:
    """`size` bytes of corpus (out/corpus.jsonl) tokenized into out/tokens by mega-tokenize (`workers`
    workers, else its default) with `tokenizer`'s: made on the first run, then reused."""
    tokens = out / "tokens"
    if not (tokens / "manifest.json").is_file():
        text = corpus(out / "corpus.jsonl", size)
        workers_args = ["--workers", str(workers)] if workers else []
        tokenize(text, tokens, tokenizer(out, text), *workers_args, "--on-error", "skip")
    vocab = json.loads((tokens / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    return Text(out, size, tokens, vocab)


def train_data() -> Text:
    """The CPU training benchmarks' data: 2 MB of the standard library's sources, tokenized."""
    return text_data(TRAIN_OUT, 2 << 20)


def gpu_data() -> Text:
    """The GPU benchmarks' data (bench_gpu, bench_gpu_peers): 8 MB, tokenized in bench-out/gpu/tokens,
    which a GPU machine with no tokenizer at hand can be given ready made."""
    return text_data(OUT / "gpu", 8 << 20, workers=None)


def tokenize_inputs(quick: bool) -> tuple[Path, Path]:
    """mega-tokenize's benchmarks' corpus (every text `corpus` finds, at least 200 MB; `quick`: 8
    MB) and tokenizer (the real one, else an 8k BPE trained on it), in bench-out/tokenize."""
    size = (8 if quick else 200) << 20
    text = corpus(OUT / "tokenize" / f"corpus-{size >> 20}MB.jsonl", size, wide=True)
    return text, tokenizer(OUT / "tokenize", text, 8000)


# --- children ------------------------------------------------------------------------------------


def tool_command(tool: str) -> list:
    """The console script, or the same entry point through this python where it is not installed
    (a GPU machine with the sources on PYTHONPATH)."""
    script = Path(sys.executable).parent / tool
    module = tool.replace("-", "_")
    return [script] if script.exists() else [sys.executable, "-c", f"from {module}.cli import main; main()"]


class ChildFailed(RuntimeError):
    """A child that exited non-zero: its exit code and what its output says."""


@dataclass
class Child:
    """A finished child: exit code, wall seconds (from its start to its exit), peak RSS (bytes, its
    own: `peak_rss`), CPU seconds (user + system), its output (empty when it went to a log file)."""

    code: int
    seconds: float
    rss: int
    cpu: float
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False

    def ok(self) -> Child:
        """This child, or ChildFailed with its exit code and the tail of its stderr."""
        if self.code:
            why = " (killed: ran past its timeout)" if self.timed_out else ""
            raise ChildFailed(f"exit {self.code}{why}: {self.stderr[-3000:]}")
        return self

    def result(self) -> dict:
        """The JSON object of its stdout's last line (what a benchmark's child prints)."""
        return json.loads(self.ok().stdout.strip().splitlines()[-1])


def launch(
    cmd: Sequence[object], *, env: dict[str, str] | None = None, cwd: Path | None = None,
    log: Path | None = None, timeout: float | None = None,
) -> Child:  # fmt: skip
    """Run `cmd` (`env`, `cwd`; its stdout and stderr captured, or both into `log`; killed after
    `timeout` s) through a small launcher process, which times it and reads its peak RSS. Started
    from this process directly, a child's ru_maxrss would start at this process's high-water mark
    (Linux carries it across exec: a 1 GB Python starting `true` read 1034 MB); the launcher's is
    about 11 MB."""
    read, write = os.pipe()
    argv = [sys.executable, "-c", _launcher_code(), str(write), str(timeout or 0), *map(str, cmd)]
    with open(log, "wb") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            argv, stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT if out else subprocess.PIPE,
            env=env, cwd=cwd, pass_fds=(write,), text=True,
        )  # fmt: skip
        os.close(write)
        stdout, stderr = proc.communicate()
    with os.fdopen(read) as f:
        report = f.read()
    if not report:  # the launcher itself failed (the command not found): its traceback says why
        return Child(proc.returncode or 1, 0.0, 0, 0.0, stdout or "", stderr or "")
    return Child(**json.loads(report), stdout=stdout or "", stderr=stderr or "")


def peak_rss(usage) -> int:
    """The peak-memory reader: a finished child's peak resident memory in bytes, from the rusage
    `os.wait4` returned for it (ru_maxrss, kB on Linux): its own peak, or that of a process it
    started and waited for if larger (not a sum), nothing else."""
    return usage.ru_maxrss * 1024


def _launcher() -> None:
    """The launcher process's program (`launch` runs it with `peak_rss` as `python -c`): argv FD
    TIMEOUT CMD...; runs CMD (this process's stdout and stderr), kills it after TIMEOUT s (0: never)
    and writes its exit code, wall and CPU seconds and peak RSS to the pipe FD as JSON."""
    import json
    import os
    import subprocess
    import sys
    import threading
    import time

    fd, timeout, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
    if timeout:
        timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
    report = {"code": proc.returncode, "seconds": seconds, "rss": peak_rss(usage)}
    report |= {"cpu": usage.ru_utime + usage.ru_stime, "timed_out": killed.is_set()}
    os.write(fd, json.dumps(report).encode())


@functools.cache
def _launcher_code() -> str:
    import inspect

    return f"{inspect.getsource(peak_rss)}\n{inspect.getsource(_launcher)}\n_launcher()\n"


def last_line(text: str, width: int = 160) -> str:
    """The last meaningful line of an error output, shortened: what a note quotes."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("WARNING", "  "))]
    line = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return line if len(line) <= width else line[: width - 3] + "..."


def tokenize(src: Path, tokens: Path, model: Path, *args: str, env: dict[str, str] | None = None) -> Child:
    """`mega-tokenize SRC TOKENS --tokenizer MODEL --no-progress ARGS`, which must succeed."""
    return launch(
        [*tool_command("mega-tokenize"), src, tokens, "--tokenizer", model, "--no-progress", *args], env=env
    ).ok()


def tokenize_command(src: Path, model: Path, out: Path, engine: str) -> tuple[Child, dict]:
    """The `mega-tokenize` command as a user runs it (interpreter start and imports included), 2
    workers, `--engine ENGINE --force --json`: the child (wall, peak RSS, CPU) and its summary."""
    args = ["--workers", str(THREADS), "--engine", engine, "--force", "--json"]
    child = tokenize(src, out, model, *args, env={**os.environ, **TOKENIZE_ENV})
    return child, child.result()


# --- the training benchmarks: a Llama run, its data, mega-train and the peers as subprocesses ----


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


LLAMA_125M = Setup(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, seq=512)  # the CPU benchmarks'
LLAMA_TINY = Setup(hidden=128, layers=2, heads=4, kv_heads=2, ffn=384, seq=128, warmup=1, timed=2, rounds=1)
LLAMA_1B = Setup(  # TinyLlama-1.1B's shape, the GPU benchmarks'
    hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, seq=2048, micro=8, accum=2, warmup=4, timed=20
)


def cpu_setup(quick: bool, rounds: int | None = None) -> Setup:
    """LLAMA_TINY or LLAMA_125M (`rounds` of it), and in fp32 (`cpu_precision`) LLAMA_125M's steps
    cut to 1 warm-up and 3 timed: an fp32 step takes several times a bf16 one on a CPU with AMX."""
    setup = LLAMA_TINY if quick else LLAMA_125M
    if not quick and cpu_precision() == "fp32":
        setup = replace(setup, warmup=1, timed=3)
    return setup if rounds is None else replace(setup, rounds=rounds)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def rows_file(setup: Setup, tokens: Path, out: Path) -> Path:
    """steps x global batch rows of seq + 1 token ids from the start of the artifact (int64 .npy,
    in `out`): what the peers read (mega-train reads the artifact itself)."""
    import numpy as np

    from megacore.data.indexed import IndexedReader

    n = setup.steps * setup.global_batch
    stream = np.concatenate(
        [IndexedReader(p.with_suffix("")).tokens for p in sorted(tokens.glob("shards/*.idx"))]
    )
    if len(stream) < n * (setup.seq + 1):
        raise RuntimeError(f"{len(stream)} tokens in {tokens}, need {n * (setup.seq + 1)}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rows-{n}x{setup.seq + 1}.npy"
    np.save(path, stream[: n * (setup.seq + 1)].astype(np.int64).reshape(n, setup.seq + 1))
    return path


def prepare_data(setup: Setup) -> tuple[Path, Path, int]:
    """The CPU training benchmarks' tokens artifact (for mega-train), the rows every other
    configuration reads (`rows_file`) and the vocab size."""
    data = train_data()
    return data.tokens, rows_file(setup, data.tokens, TRAIN_OUT), data.vocab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(distributed: bool = False) -> dict[str, str]:
    """A training child's environment: THREADS threads, offline; `distributed`: a 1-process
    torch.distributed group for the engine (what torchrun would set)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if distributed:
        env.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    return env


def measure_child(
    script: Path, kind: str, setup: Setup, rows: Path, work: Path, *, python: Path | str = sys.executable,
    distributed: bool = True, **extra: str,
) -> dict:  # fmt: skip
    """One configuration in a fresh subprocess, `python SCRIPT --child KIND SPEC` in `work` (`extra`:
    more fields of SPEC; its precision `cpu_precision`'s unless given; `distributed`: `child_env`'s):
    its result (what `child_main` wrote) plus its peak RSS as "rss", or {"error": ...}."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = {"setup": asdict(setup), "rows": str(rows), "work": str(work), "result": str(work / "result.json")}
    spec |= {"precision": cpu_precision()} | extra
    (work / "spec.json").write_text(json.dumps(spec))
    cmd = [python, script, "--child", kind, work / "spec.json"]
    child = launch(cmd, env=child_env(distributed), cwd=work, log=work / "log.txt", timeout=CHILD_TIMEOUT)
    result = work / "result.json"
    if child.code or not result.is_file():
        return {"error": f"exit {child.code}: {last_line((work / 'log.txt').read_text(errors='replace'))}"}
    return {**json.loads(result.read_text()), "rss": child.rss}


def child_main(kind: str, spec_path: str, children: dict[str, Callable[[Setup, dict], dict]]) -> None:
    """`SCRIPT --child KIND SPEC`: child `kind` of `children` on SPEC; its result into SPEC's file."""
    spec = json.loads(Path(spec_path).read_text())
    result = children[kind](Setup(**spec["setup"]), spec)
    Path(spec["result"]).write_text(json.dumps(result))


def main(
    run: Callable[[bool], list], children: dict[str, Callable[[Setup, dict], dict]] | None = None
) -> None:
    """A benchmark run as a script: `--child KIND SPEC` runs one of its `children`; else its `run`
    (`--quick`: small sizes) and run.py's table of the rows, exit 1 when one fails its checked target."""
    if children and sys.argv[1:2] == ["--child"]:
        return child_main(sys.argv[2], sys.argv[3], children)
    from run import table

    rows = run("--quick" in sys.argv)
    print(table(rows))
    sys.exit(1 if any(r.passed is False for r in rows) else 0)


def ours_config(setup: Setup) -> dict:
    return dict(
        family="llama", vocab_size=setup.vocab, hidden_size=setup.hidden, num_layers=setup.layers,
        num_heads=setup.heads, num_kv_heads=setup.kv_heads, ffn_hidden_size=setup.ffn, max_seq_len=setup.seq,
    )  # fmt: skip


def mega_manifest(
    setup: Setup, tokens: Path, recompute: str = "none", compile: bool = False, **extra
) -> dict:
    return {
        "kind": "run", "format_version": 1,
        "model": {"config": ours_config(setup)},
        "data": {"sources": [{"path": str(tokens)}], "split": [1, 0]},
        "batch": {"micro_batch_size": setup.micro, "global_batch_size": setup.global_batch, "seq_length": setup.seq},
        "train_steps": setup.steps, "precision": cpu_precision(), "recompute": recompute, "compile": compile,
        "optimizer": {"lr": 3e-4, "warmup_steps": 0}, "logging": {"every": 1}, "checkpoint": {"every": 100000},
    } | extra  # fmt: skip


def run_mega_train(manifest: dict, work: Path) -> tuple[list[dict], int]:
    """`mega-train --manifest run.json` of `manifest` (its "out": work/run-out) in a fresh `work`:
    the records of its metrics.jsonl and its peak RSS, or ChildFailed (exit code, the log's last
    line). Its checkpoints are deleted (weights and AdamW state: GBs, not needed)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out, log = work / "run-out", work / "log.txt"
    (work / "run.json").write_text(json.dumps({**manifest, "out": str(out)}, indent=2))
    cmd = [*tool_command("mega-train"), "--manifest", work / "run.json"]
    child = launch(cmd, env=child_env(), cwd=work, log=log, timeout=CHILD_TIMEOUT)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if child.code or not (out / "metrics.jsonl").is_file():
        raise ChildFailed(f"exit {child.code}: {last_line(log.read_text(errors='replace'))}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()], child.rss


def measure_mega_train(
    setup: Setup, tokens: Path, work: Path, recompute: str = "none", compile: bool = False, **extra
) -> dict:
    """`run_mega_train` of `mega_manifest` (`extra`: more manifest fields); tokens/s from the
    `step_time_s` of the steps after the warm-up ones, and those steps' records, or {"error": ...}."""
    try:
        records, rss = run_mega_train(mega_manifest(setup, tokens, recompute, compile, **extra), work)
    except ChildFailed as e:
        return {"error": str(e)}
    steps = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])[setup.warmup :]
    if len(steps) < setup.timed:
        where = work / "run-out" / "metrics.jsonl"
        return {"error": f"{len(steps)} train steps after the warm-up in {where}, expected {setup.timed}"}
    return {
        "tokens_per_s": setup.timed_tokens / sum(r["step_time_s"] for r in steps),
        "rss": rss,
        "records": steps,
    }


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
    print(f"bench: step times after the first: {times}", file=sys.stderr, flush=True)  # in log.txt
    return setup.timed_tokens / (step_ends[-1] - step_ends[setup.warmup - 1])


def trainer_feed(setup: Setup, spec: dict, clock: Callable[[], float] = time.perf_counter) -> tuple:
    """What a Trainer configuration is given: a dataset of the rows (input and labels alike: the
    model shifts the labels itself) and a callback recording each step's end and its span from
    on_step_begin (`ends`, `spans`) by `clock`."""
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
            self.begin = clock()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(clock())
            self.spans.append(self.ends[-1] - self.begin)

    return Rows(), StepEnds()


def hf_llama(setup: Setup, device: str = "cpu"):
    """transformers' LlamaForCausalLM of the setup's shape (untied output, sdpa), random weights
    (seed 0), initialised on `device` (a 3B init on the CPU takes a while)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=setup.ffn,
        num_hidden_layers=setup.layers, num_attention_heads=setup.heads, num_key_value_heads=setup.kv_heads,
        max_position_embeddings=setup.seq, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device(device):
        return LlamaForCausalLM(config)


def hf_tokenizer(model: Path, out: Path) -> Path:
    """The SentencePiece model as a transformers tokenizer directory `out` (what TRL's trainers
    tokenize with), made once."""
    if not (out / "tokenizer_config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(model, out / "tokenizer.model")
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def lora_base(setup: Setup) -> tuple[Path, Path]:
    """The random Llama as transformers saves it, and converted by mega-convert (the base bench_lora
    and bench_dpo start from; made once): (HF directory, checkpoint)."""
    work = OUT / "lora"
    hf, ckpt = work / f"base-hf-{setup.layers}x{setup.hidden}", work / f"base-{setup.layers}x{setup.hidden}"
    if not (ckpt / "manifest.json").is_file():
        hf_llama(setup).save_pretrained(hf)
        launch([*tool_command("mega-convert"), "hf", hf, ckpt, "--force"]).ok()
    return hf, ckpt


# --- a training step in this process (bench_model, bench_moe, bench_families) --------------------


def train_step(model, is_hf: bool, ids, compile: bool = False) -> Callable[[], float]:
    """One timed training step of `model` on `ids` as each side runs it: transformers' computes the
    logits, then the fp32 loss; megacore's passes the targets to the model (the loss fused with the
    output projection); fused AdamW over what it trains. `compile`: per block, both sides alike
    (one compiled graph reused by every layer)."""
    import torch
    import torch.nn.functional as F

    if compile:
        if is_hf:
            for layer in model.model.layers:
                layer.compile(dynamic=False)
        else:
            model.compile_blocks()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x, y = ids[:, :-1], ids[:, 1:]

    def step() -> float:
        t = time.perf_counter()
        if is_hf:
            loss = F.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1).float(), y.flatten())
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    return step


def ours_from_hf(peer, hf_config):
    """megacore's Decoder with the weights of transformers' `peer` (saved, then read by their
    checkpoint names: per-expert projections included)."""
    import tempfile

    from safetensors.torch import load_file

    from megacore.models import Decoder, config_from_hf, hf_state_dict_to_ours

    with tempfile.TemporaryDirectory() as tmp:
        peer.save_pretrained(tmp)
        state = load_file(Path(tmp) / "model.safetensors")
    cfg = config_from_hf(hf_config)
    ours = Decoder(cfg)
    ours.load_state_dict(hf_state_dict_to_ours(cfg, state))
    return ours


# --- random checkpoints (bench_shard, bench_checkpoint) ------------------------------------------


LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008
)
SMALL_DIMS = dict(  # the checkpoint benchmarks' --quick
    vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, ffn_hidden_size=1408
)
BLOCK = 32 << 20  # bytes written (and read back) at a time
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")  # AdamW moments, fp32, one per parameter and kind


def checkpoint_tensors(cfg, optim: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype): the bf16 weights, then (`optim`) each one's fp32 AdamW moments."""
    from megacore.parallel.layout import optim_state_name
    from megacore.parts import model_tensors

    shapes = model_tensors(cfg)
    out = {n: (s, "bfloat16") for n, s in shapes.items()}
    if optim:
        out |= {optim_state_name(k, n): (s, "float32") for n, s in shapes.items() for k in OPTIM_KINDS}
    return out


def write_checkpoint(out: Path, cfg, optim: bool) -> int:
    """A checkpoint of random weights and moments (random bits, streamed block by block), one piece
    per tensor, in one file (the tp1/pp1 layout of mega-convert and of a one-rank training save):
    its bytes."""
    import math

    import numpy as np
    import torch

    from megacore.artifacts import whole, write_artifact
    from megacore.artifacts.manifest import Layout, TrainingState
    from megacore.checkpoint import CheckpointWriter, shard_file

    tensors = checkpoint_tensors(cfg, optim)
    rng = np.random.default_rng(0)
    with write_artifact(out, "checkpoint", force=True) as w:
        cw = CheckpointWriter(w)
        file = shard_file(0, 0)
        sw = cw.open_file(file, [(n, s, d, whole(s)) for n, (s, d) in tensors.items()])
        for name, (shape, dtype) in tensors.items():
            left = math.prod(shape) * (2 if dtype == "bfloat16" else 4)
            while left:
                n = min(BLOCK, left)
                sw.write(name, torch.frombuffer(bytearray(rng.bytes(n)), dtype=torch.uint8))
                left -= n
        cw.close_file(file, sw)
        layout = Layout(stage_layers=[list(range(cfg.num_layers))])
        training = TrainingState(step=1, optimizer="adamw") if optim else None
        cw.commit(config=cfg, dtype="bfloat16", layout=layout, producer=("bench", "0"), training=training)
    return sw.size
