"""mega-tokenize on a Parquet corpus against the same rows as jsonl: wall time and peak memory.

Corpus: bench_tokenize's (benchlib's `tokenize_inputs`: real text found on this machine as jsonl
rows `{"text", "src"}`, at least 200 MB; `--quick`: 8 MB) and the same rows written as one Parquet
file the way a Hub dataset is (pyarrow's defaults: snappy, dictionary encoding; row groups of
ROW_GROUP rows, both columns), cached in bench-out/parquet/ (git-ignored).

Measured: the `mega-tokenize` command as a user runs it, `--workers 2`, the same engine on both
sides (the one `--engine auto` picks on the jsonl in the warm-up, then named), each run a child of
a small launcher process, so its peak RSS is the child's own ru_maxrss (benchlib's `launch`: a
child forked from this process would carry this process's peak). Timing: each path once to warm
up, then ROUNDS rounds of each once, the order rotated (benchlib's `paired_rounds`). Ratios are the
median over rounds of jsonl / Parquet (time: > 1 means Parquet is faster) and Parquet / jsonl
(peak RSS: < 1 means Parquet needs less). Checked (the run exits 1 otherwise): the two artifacts'
shards are byte-identical (.bin and .idx).

Hugging Face datasets (`run_datasets`, group `datasets`): the same rows as a `save_to_disk` Dataset
(written by `datasets` itself, two Arrow files in record batches of 1000 rows; read with pyarrow
alone) and as a dataset repository's directory (the Parquet file as data/train-00000-of-00001.parquet
and a README.md declaring its config; streamed by `datasets`), each against the jsonl, measured the
same way, DATASET_ROUNDS rounds; shards checked byte-identical to the jsonl run's.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchlib import OUT as BENCH_OUT
from benchlib import THREADS, median_ratio, paired_rounds, tokenize_command, tokenize_inputs
from run import Row

OUT = BENCH_OUT / "parquet"
ROW_GROUP = 1000  # rows per row group, as the `datasets` library writes a Hub dataset's files
ROUNDS = 5
QUICK_ROUNDS = 2
DATASET_ROUNDS = 3  # three whole commands per round: fewer rounds than Parquet's
CARD = (  # a dataset repository's README.md: one config, its train split in data/
    "---\nconfigs:\n- config_name: default\n  default: true\n  data_files:\n"
    "  - split: train\n    path: data/train-*.parquet\n---\n"
)


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
    """Wall seconds, peak RSS (bytes), CPU seconds (user + system: steadier than wall time on a
    shared machine) and the --json summary of one `mega-tokenize` run."""
    child, summary = tokenize_command(src, model, out, engine)
    return child.seconds, child.rss, child.cpu, summary


def same_shards(a: Path, b: Path) -> list[str]:
    """The shard files whose bytes differ, or that only one side has."""
    names = sorted({p.name for d in (a, b) for p in (d / "shards").iterdir()})

    def differs(n: str) -> bool:
        x, y = a / "shards" / n, b / "shards" / n
        return not (x.is_file() and y.is_file()) or x.read_bytes() != y.read_bytes()

    return [n for n in names if differs(n)]


def rounds_of(srcs: dict[str, Path], model: Path, engine: str, rounds: int):
    """Each path once to warm up, then `rounds` paired rounds: times, peak RSS, CPU, documents."""
    runs = paired_rounds(
        srcs,
        rounds,
        lambda k, _: command(srcs[k], model, OUT / f"tokens-{k}", engine),
        warmup=True,
        rotate=True,
    )
    times, rss, cpu = ({k: [run[i] for run in v] for k, v in runs.items()} for i in range(3))
    return times, rss, cpu, {k: v[-1][3]["documents"] for k, v in runs.items()}


def run(quick: bool) -> list[Row]:
    return [*run_parquet(quick), *run_datasets(quick)]


def run_parquet(quick: bool) -> list[Row]:
    corpus, model = tokenize_inputs(quick)
    srcs = {"jsonl": corpus, "parquet": to_parquet(corpus)}
    rounds = QUICK_ROUNDS if quick else ROUNDS
    # The engine --engine auto picks (on the jsonl), named on both sides from then on.
    engine = command(corpus, model, OUT / "tokens-jsonl", "auto")[3]["engine"]
    times, rss, cpu, docs = rounds_of(srcs, model, engine, rounds)
    differ = same_shards(OUT / "tokens-jsonl", OUT / "tokens-parquet")
    best = {k: min(v) for k, v in times.items()}
    peak = {k: max(v) for k, v in rss.items()}
    mb, pq_mb = (p.stat().st_size / 1e6 for p in srcs.values())
    t_ratio, c_ratio = (
        median_ratio(times["jsonl"], times["parquet"]),
        median_ratio(cpu["jsonl"], cpu["parquet"]),
    )
    m_ratio = median_ratio(rss["parquet"], rss["jsonl"])
    lines = [
        f"corpus {mb:.0f} MB as jsonl, {pq_mb:.0f} MB as Parquet (row groups of {ROW_GROUP} rows, snappy), "
        f"{docs['parquet']:,} documents, tokenizer {model.name}, {THREADS} workers, engine {engine}, "
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
        Row("parquet", f"time, {THREADS} workers, vs the same rows as jsonl", f"{best['parquet']:.1f}s",
            f"{best['jsonl']:.1f}s (jsonl)", t_ratio, "~1x (same parallel speed)",
            f"{note}; median of {rounds} paired rounds; whole commands; CPU ratio {c_ratio:.2f}x"),
        Row("parquet", "peak RSS vs the same rows as jsonl", f"{peak['parquet'] / 2**20:.0f} MiB",
            f"{peak['jsonl'] / 2**20:.0f} MiB (jsonl)", 1 / m_ratio, "~1x (bounded, not the file)",
            f"max over rounds; ratio jsonl/parquet, median of rounds; row groups of {ROW_GROUP} rows"),
        Row("parquet", "shards = the jsonl run's", "byte-identical" if not differ else "differ",
            "jsonl .bin/.idx", None, "equal", ", ".join(differ) or ".bin and .idx equal",
            passed=not differ),
    ]  # fmt: skip


# --- Hugging Face datasets --------------------------------------------------------------------------


def to_saved(parquet: Path) -> Path:
    """The rows as a Dataset written by `datasets`' save_to_disk (two Arrow files), once."""
    import datasets
    import pyarrow.parquet as pq

    path = OUT / "saved"
    if (path / "state.json").is_file():
        return path
    tmp = OUT / "saved.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.disable_progress_bars()
    datasets.Dataset(datasets.table.InMemoryTable(pq.read_table(parquet))).save_to_disk(
        str(tmp), num_shards=2
    )
    tmp.rename(path)
    return path


def to_repository(parquet: Path) -> Path:
    """A dataset repository's directory: the Parquet file as its data and a card declaring it, once."""
    path = OUT / "repository"
    if (path / "README.md").is_file():
        return path
    tmp = OUT / "repository.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    shutil.copyfile(parquet, tmp / "data" / "train-00000-of-00001.parquet")
    (tmp / "README.md").write_text(CARD)
    tmp.rename(path)
    return path


def run_datasets(quick: bool) -> list[Row]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return [
            Row(
                "datasets", "save_to_disk, repository vs jsonl", "-", "-", None, note="datasets not installed"
            )
        ]
    corpus, model = tokenize_inputs(quick)
    parquet = to_parquet(corpus)
    srcs = {"jsonl": corpus, "saved": to_saved(parquet), "repository": to_repository(parquet)}
    rounds = QUICK_ROUNDS if quick else DATASET_ROUNDS
    engine = command(corpus, model, OUT / "tokens-jsonl", "auto")[3]["engine"]
    times, rss, cpu, docs = rounds_of(srcs, model, engine, rounds)
    mb = corpus.stat().st_size / 1e6
    print(f"bench_parquet: datasets: corpus {mb:.0f} MB as jsonl, {docs['jsonl']:,} documents, {THREADS} "
          f"workers, engine {engine}, 1 warm-up + {rounds} rounds of each", file=sys.stderr, flush=True)  # fmt: skip
    rows = []
    for kind in ("saved", "repository"):
        rows += _dataset_rows(kind, times, rss, cpu, rounds, docs[kind] == docs["jsonl"])
    return rows


def _dataset_rows(kind: str, times: dict, rss: dict, cpu: dict, rounds: int, same_docs: bool) -> list[Row]:
    """One kind of dataset against the jsonl: its figures printed, its rows."""
    differ = same_shards(OUT / "tokens-jsonl", OUT / f"tokens-{kind}")
    t_ratio, c_ratio = median_ratio(times["jsonl"], times[kind]), median_ratio(cpu["jsonl"], cpu[kind])
    m_ratio = median_ratio(rss[kind], rss["jsonl"])
    peak, peak_jsonl = max(rss[kind]), max(rss["jsonl"])
    what = {"saved": "save_to_disk (pyarrow)", "repository": "repository (datasets, streaming)"}[kind]
    lines = [
        *(f"{k}: best {min(times[k]):.2f}s, rounds {' '.join(f'{t:.2f}' for t in times[k])}" for k in (kind, "jsonl")),
        f"{kind}: CPU (user+sys) best {min(cpu[kind]):.2f}s, rounds {' '.join(f'{t:.2f}' for t in cpu[kind])}",
        *(f"{k}: peak RSS max {max(rss[k]) / 2**20:.0f} MiB, rounds {' '.join(f'{r / 2**20:.0f}' for r in rss[k])}"
          for k in (kind, "jsonl")),
        f"time jsonl/{kind}, median of paired rounds: {t_ratio:.2f}x; CPU {c_ratio:.2f}x",
        f"peak RSS {kind}/jsonl, median of paired rounds: {m_ratio:.2f}x",
        f"shards: {'byte-identical' if not differ else 'DIFFER: ' + ', '.join(differ)}",
    ]  # fmt: skip
    for line in lines:
        print(f"bench_parquet: datasets: {line}", file=sys.stderr, flush=True)
    ok = not differ and same_docs
    return [
        Row("datasets", f"{what}: time vs the same rows as jsonl", f"{min(times[kind]):.1f}s",
            f"{min(times['jsonl']):.1f}s (jsonl)", t_ratio, "~1x",
            f"median of {rounds} paired rounds; whole commands; CPU ratio {c_ratio:.2f}x"),
        Row("datasets", f"{what}: peak RSS vs jsonl", f"{peak / 2**20:.0f} MiB", f"{peak_jsonl / 2**20:.0f} MiB (jsonl)",
            1 / m_ratio, "~1x (bounded, not the dataset)", "max over rounds; ratio jsonl/ours, median of rounds"),
        Row("datasets", f"{what}: shards = the jsonl run's", "byte-identical" if ok else "differ", "jsonl .bin/.idx",
            None, "equal", ", ".join(differ) or ".bin and .idx equal", passed=ok),
    ]  # fmt: skip
