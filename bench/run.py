"""`make bench`: run every bench/bench_*.py and print one table of ratios against peers.

Each benchmark module has `run(quick: bool) -> list[Row]`. Ours and the peer are measured side by
side in the same run (this machine is shared and noisy: ratios, never absolute times alone).
`python bench/run.py [NAME ...] [--quick]` runs a subset.

A row whose target is checked by its benchmark (ids that must agree, a memory ceiling) says so in the
`check` column: `ok`, or `FAIL`, which makes the run exit 1 after printing the whole table. Other
targets are goals to read against the ratio, not checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Row:
    benchmark: str
    metric: str
    ours: str
    peer: str
    ratio: float | None  # >1 means we are better, whatever the metric's direction
    target: str = ""
    note: str = ""
    passed: bool | None = None  # None: target not checked; False: the row fails the run (exit 1)


def discover() -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py"))}


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def table(rows: list[Row]) -> str:
    head = ("benchmark", "metric", "ours", "peer", "ratio", "target", "check", "note")
    body = [
        (
            r.benchmark,
            r.metric,
            r.ours,
            r.peer,
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.target,
            {None: "", True: "ok", False: "FAIL"}[r.passed],
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, b)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all): {', '.join(discover())}")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the benchmarks run")
    args = ap.parse_args(argv)
    found = discover()
    names = args.names or list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        print(f"bench: error: unknown benchmark(s) {unknown}; have {sorted(found)}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    failed = False
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            rows += load(found[name]).run(args.quick)
        except Exception:
            failed = True
            traceback.print_exc()
            rows.append(Row(name, "error", "-", "-", None, note="failed, see traceback above"))
        print(f"   {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    if not rows:
        rows.append(Row("(none)", "-", "-", "-", None, note="no benchmarks yet"))
    print(table(rows))
    failing = [f"{r.benchmark}: {r.metric}" for r in rows if r.passed is False]
    if failing:
        print(
            f"bench: {len(failing)} row(s) failed their checked target: {'; '.join(failing)}", file=sys.stderr
        )
    return 1 if failed or failing else 0


if __name__ == "__main__":
    sys.exit(main())
