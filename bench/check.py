"""`make bench-check`: the guarded ratios of bench/README.md measured again, in a few paired rounds,
failing when one falls more than TOLERANCE (10%) below the figure recorded there.

Run it before landing a change to the training step, the engine, the allocator or a loss: speed
lost there shows in no test (timings drift, so `make test` times nothing), and a later session
would have to bisect for it. The guarded rows are the CPU trainer against transformers' `Trainer`
(bench_train), LoRA against the Trainer with PEFT (bench_lora) and DPO against TRL's `DPOTrainer`
(bench_dpo), each benchmark's `check(rounds)`: only that comparison, `ROUNDS` interleaved rounds
(benchlib's `paired_rounds`: each side once a round, the order reversed every other round), their
paired ratios' median.

The figures are read from the table under "## Guarded ratios" in bench/README.md, one row per
(benchmark, metric, precision). A CPU with bf16 matmuls (AMX or AVX512-BF16) runs the benchmarks
in bf16, any other in fp32 (benchlib's `cpu_precision`), and the two give other ratios, so each
precision has its own figures; a row of the other precision is skipped, and a guarded metric with
no figure for this precision is reported without a verdict (record one: the note says so). Exit 1
when a row falls below its figure x (1 - TOLERANCE) or a side fails; `--rounds N` for more rounds
(a verdict near the line deserves them: this machine's speed drifts up to 2x minute to minute).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from benchlib import cpu_precision
from run import Row, load, table

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
GUARDED = ("train", "lora", "dpo")
ROUNDS = 3
TOLERANCE = 0.10
SECTION = "## Guarded ratios"


@dataclass(frozen=True)
class Figure:
    benchmark: str
    metric: str
    precision: str
    ratio: float


def recorded(text: str) -> list[Figure]:
    """The figures of the README's guarded table: rows `| benchmark | metric | precision | 1.44x |
    ...` under SECTION, up to the next heading."""
    if SECTION not in text:
        raise SystemExit(f"bench-check: {README} has no '{SECTION}' section")
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    figures = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and (m := re.fullmatch(r"(\d+(?:\.\d+)?)x", cells[3])) and cells[0] in GUARDED:
            figures.append(Figure(cells[0], cells[1], cells[2], float(m.group(1))))
    return figures


def verdicts(rows: list[Row], figures: list[Figure], precision: str) -> list[Row]:
    """Each measured row with its figure (this precision's) as the target, and whether it holds."""
    by = {(f.benchmark, f.metric, f.precision): f for f in figures}
    out = []
    for row in rows:
        fig = by.get((row.benchmark, row.metric, precision))
        if row.ratio is None:
            out.append(replace(row, passed=False))
        elif fig is None:
            note = f"no {precision} figure in {README.name}'s guarded table: record one; {row.note}"
            out.append(replace(row, target="-", note=note, passed=None))
        else:
            floor = fig.ratio * (1 - TOLERANCE)
            target = f">= {floor:.2f}x ({fig.ratio:.2f}x recorded - {TOLERANCE:.0%})"
            out.append(replace(row, target=target, passed=row.ratio >= floor))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(GUARDED), help=f"of {', '.join(GUARDED)} (default: all)")
    ap.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"paired rounds per benchmark (default {ROUNDS})"
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.names) - set(GUARDED))
    if unknown:
        print(f"bench-check: error: not guarded: {unknown}; guarded: {', '.join(GUARDED)}", file=sys.stderr)
        return 2
    figures = recorded(README.read_text())
    precision = cpu_precision()
    rows = []
    for name in args.names:
        print(
            f"bench-check: {name}, {args.rounds} paired rounds, {precision} ...", file=sys.stderr, flush=True
        )
        rows += load(HERE / f"bench_{name}.py").check(args.rounds)
    checked = verdicts(rows, figures, precision)
    print(table(checked))
    failed = [r for r in checked if r.passed is False]
    for r in failed:
        print(
            f"bench-check: FAIL: {r.benchmark}: {r.metric}: {r.note if r.ratio is None else r.ratio}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
