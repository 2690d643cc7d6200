"""mega-tokenize on a Parquet corpus against the same rows as jsonl: wall time and peak memory.

Corpus: bench_tokenize's (real text found on this machine as jsonl rows `{"text", "src"}`, at least
200 MB; `--quick`: 8 MB) and the same rows written as one Parquet file the way a Hub dataset is
(pyarrow's defaults: snappy, dictionary encoding; row groups of ROW_GROUP rows, both columns),
cached in bench-out/parquet/ (git-ignored).

Measured: the `mega-tokenize` command as a user runs it, `--workers 2`, the same engine on both
sides (the one `--engine auto` picks on the jsonl in the warm-up, then named), each run a child of
a small launcher process, so its peak RSS is the child's own ru_maxrss (a child forked from this
process would carry this process's pages until exec). Timing: each path once to warm up, then
ROUNDS rounds of each once, the order alternated (bench_tokenize's `paired_rounds`). Ratios are the
median over rounds of jsonl / Parquet (time: > 1 means Parquet is faster) and Parquet / jsonl
(peak RSS: < 1 means Parquet needs less). Checked (the run exits 1 otherwise): the two artifacts'
shards are byte-identical (.bin and .idx).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_tokenize import WORKERS, _tokenizer_model, build_corpus, paired, paired_rounds
from run import Row

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out" / "parquet"
ROW_GROUP = 1000  # rows per row group, as the `datasets` library writes a Hub dataset's files
ROUNDS = 5
QUICK_ROUNDS = 2
SUB_ENV = {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": str(WORKERS)}

# The launcher: runs one command, prints its exit code, wall seconds, peak RSS (bytes), CPU seconds
# (user + system: steadier than wall time on a shared machine) and its stdout.
_LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
out = proc.stdout.read()
_, status, usage = os.wait4(proc.pid, 0)
seconds = time.perf_counter() - t0
cpu = usage.ru_utime + usage.ru_stime
print(json.dumps([os.waitstatus_to_exitcode(status), seconds, usage.ru_maxrss * 1024, cpu, out.decode()]))
"""


def to_parquet(corpus: Path) -> Path:
    """The corpus's rows (both columns, in order) as one Parquet file, written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = OUT / corpus.with_suffix(".parquet").name
    if path.is_file():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    schema = pa.schema([("text", pa.string()), ("src", pa.string())])
    rows: dict[str, list] = {"text": [], "src": []}
    with open(corpus, "rb") as f, pq.ParquetWriter(tmp, schema) as w:
        for line in f:
            rec = json.loads(line)
            for k in rows:
                rows[k].append(rec[k])
            if len(rows["text"]) == ROW_GROUP:
                w.write_table(pa.table(rows, schema=schema))
                rows = {"text": [], "src": []}
        if rows["text"]:
            w.write_table(pa.table(rows, schema=schema))
    tmp.rename(path)
    return path


def command(src: Path, model: Path, out: Path, engine: str) -> tuple[float, int, float, dict]:
    """Wall seconds, peak RSS (bytes), CPU seconds and the --json summary of one `mega-tokenize` run."""
    exe = Path(sys.executable).parent / "mega-tokenize"
    args = [str(exe), str(src), str(out), "-t", str(model), "--workers", str(WORKERS), "--engine", engine]
    p = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *args, "--force", "--no-progress", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **SUB_ENV},
    )
    code, seconds, rss, cpu, stdout = json.loads(p.stdout.strip().splitlines()[-1])
    if code:
        raise RuntimeError(f"mega-tokenize {src.name} exited {code}: {p.stderr[-2000:]}")
    return seconds, rss, cpu, json.loads(stdout)


def same_shards(a: Path, b: Path) -> list[str]:
    """The shard files whose bytes differ, or that only one side has."""
    names = sorted({p.name for d in (a, b) for p in (d / "shards").iterdir()})

    def differs(n: str) -> bool:
        x, y = a / "shards" / n, b / "shards" / n
        return not (x.is_file() and y.is_file()) or x.read_bytes() != y.read_bytes()

    return [n for n in names if differs(n)]


def rounds_of(srcs: dict[str, Path], model: Path, engine: str, rounds: int):
    """Each path once to warm up, then `rounds` paired rounds: times, peak RSS, CPU, documents."""
    rss: dict[str, list[int]] = {k: [] for k in srcs}
    cpu: dict[str, list[float]] = {k: [] for k in srcs}
    docs: dict[str, int] = {}

    def path(k: str):
        def once() -> float:
            seconds, peak, used, summary = command(srcs[k], model, OUT / f"tokens-{k}", engine)
            rss[k].append(peak)
            cpu[k].append(used)
            docs[k] = summary["documents"]
            return seconds

        return once

    paths = {k: path(k) for k in srcs}
    for k in paths:
        paths[k]()
        rss[k].clear()
        cpu[k].clear()
    return paired_rounds(paths, rounds), rss, cpu, docs


def run(quick: bool) -> list[Row]:
    corpus = build_corpus((8 if quick else 200) << 20)
    srcs = {"jsonl": corpus, "parquet": to_parquet(corpus)}
    model = _tokenizer_model()
    rounds = QUICK_ROUNDS if quick else ROUNDS
    # The engine --engine auto picks (on the jsonl), named on both sides from then on.
    engine = command(corpus, model, OUT / "tokens-jsonl", "auto")[3]["engine"]
    times, rss, cpu, docs = rounds_of(srcs, model, engine, rounds)
    differ = same_shards(OUT / "tokens-jsonl", OUT / "tokens-parquet")
    best = {k: min(v) for k, v in times.items()}
    peak = {k: max(v) for k, v in rss.items()}
    mb, pq_mb = (p.stat().st_size / 1e6 for p in srcs.values())
    t_ratio, c_ratio = paired(times, "jsonl", "parquet"), paired(cpu, "jsonl", "parquet")
    m_ratio = statistics.median(p / j for p, j in zip(rss["parquet"], rss["jsonl"], strict=True))
    lines = [
        f"corpus {mb:.0f} MB as jsonl, {pq_mb:.0f} MB as Parquet (row groups of {ROW_GROUP} rows, snappy), "
        f"{docs['parquet']:,} documents, tokenizer {model.name}, {WORKERS} workers, engine {engine}, "
        f"1 warm-up + {rounds} rounds of each",
        *(f"{k}: best {best[k]:.2f}s, rounds {' '.join(f'{t:.2f}' for t in v)}" for k, v in times.items()),
        *(f"{k}: CPU (user+sys) best {min(v):.2f}s, rounds {' '.join(f'{t:.2f}' for t in v)}"
          for k, v in cpu.items()),
        *(f"{k}: peak RSS max {peak[k] / 2**20:.0f} MiB, rounds {' '.join(f'{r / 2**20:.0f}' for r in v)}"
          for k, v in rss.items()),
        f"time jsonl/parquet, median of paired rounds: {t_ratio:.2f}x (best-of "
        f"{best['jsonl'] / best['parquet']:.2f}x)",
        f"CPU jsonl/parquet, median of paired rounds: {c_ratio:.2f}x",
        f"peak RSS parquet/jsonl, median of paired rounds: {m_ratio:.2f}x",
        f"shards: {'byte-identical' if not differ else 'DIFFER: ' + ', '.join(differ)}",
    ]  # fmt: skip
    for line in lines:
        print(f"bench_parquet: {line}", file=sys.stderr, flush=True)
    note = f"{mb:.0f} MB of text, {pq_mb:.0f} MB as Parquet; engine {engine}"
    return [
        Row("parquet", f"time, {WORKERS} workers, vs the same rows as jsonl", f"{best['parquet']:.1f}s",
            f"{best['jsonl']:.1f}s (jsonl)", t_ratio, "~1x (same parallel speed)",
            f"{note}; median of {rounds} paired rounds; whole commands; CPU ratio {c_ratio:.2f}x"),
        Row("parquet", "peak RSS vs the same rows as jsonl", f"{peak['parquet'] / 2**20:.0f} MiB",
            f"{peak['jsonl'] / 2**20:.0f} MiB (jsonl)", 1 / m_ratio, "~1x (bounded, not the file)",
            f"max over rounds; ratio jsonl/parquet, median of rounds; row groups of {ROW_GROUP} rows"),
        Row("parquet", "shards = the jsonl run's", "byte-identical" if not differ else "differ",
            "jsonl .bin/.idx", None, "equal", ", ".join(differ) or ".bin and .idx equal",
            passed=not differ),
    ]  # fmt: skip
