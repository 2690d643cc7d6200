"""`make gpu-check`: the checks that need a GPU, as one prepared run on one GPU in under 8 minutes,
written to one JSON report (`--out`, default bench-out/gpu-check.json).

Parts, in this order, each a subprocess of its own (bench/gpu_check_parts.py, which holds their
sizes and bounds) with its own timeout, inside a total budget (`--budget`, BUDGET_S = 470 s): a part
starts only with MIN_PART_S of the budget left and is cut, with every process it started, at its
timeout or the budget's end, whichever comes first.
- cuda_tests: pytest on tests/models/test_cuda.py, the tests skipped without CUDA (the decoder's
  logits against transformers for 7 families, a bf16 step against fp32, the fused loss, packed
  documents, the FlashAttention kernels against SDPA, context parallel's late chunk, the grouped
  matmul against the loop) and gpt-oss's sink attention against its formula (test_gpt_oss.py);
  counts, time and failed tests from its junit XML.
- fp8: the engine (`ParallelModel`, one process) learns one fixed batch for 12 steps from the same
  weights in bf16 and in fp8 (tensorwise; torchao's Float8Linear, checked not emulated): every loss
  finite, bf16's falling, fp8's within 2% of bf16's at every step. Needs torchao and compute
  capability 8.9+.
- grouped_mm: a MoE layer's experts (`models.moe.grouped_swiglu`, 8 experts, hidden 2048, ffn 5632,
  16,384 rows routed unevenly, one expert without rows) in bf16 through `torch._grouped_mm`,
  against the loop over the experts in bf16 (what runs without it) and in fp32: the output and the
  gradients of the rows and of the weights, and both paths' times.
- cp_32k: context parallel's attention at 32,768 tokens (Llama 3 8B's 32 query and 8 kv heads of
  128) at cp 2, 4 and 8 on the one GPU: every cp rank's `ContextParallelAttention` runs in one
  process on its own chunks, only the all-gather stood in for (each rank handed every rank's shard
  of the row), so the chunk arithmetic, `unshard_sequence` and the GPU kernels of a late chunk are
  the code a run uses; the ranks' outputs, reassembled, and the q/k/v gradients against one fp32
  attention over the whole row; causal, with a 4,096-token window, and with packed documents. Not
  covered: NCCL's all-gather and reduce-scatter, and the engine's split of a row across processes
  (they need 2 GPUs; tests/parallel/test_equivalence.py runs them on a CPU with gloo).
- peers: bench/bench_gpu_peers.py, its models in turn (the 1.1B, then the 3B) while the time its
  docstring gives each (~190 s, ~215 s) still fits what is left; its rows (tokens/s, TFLOP/s, MFU,
  peak memory; the ratios against the Trainer and the compiled loop) kept after each model.

Each part is "passed", "failed" (a check that does not hold, an error, or cut at its timeout:
`timed_out`) or "skipped" with the reason (no CUDA device; a module missing, such as msgspec or
torchao; too little GPU memory; the budget spent). Without a CUDA device every part is skipped and
the run exits 0 in seconds; else it exits 1 when a part failed. Each part's output is in
bench-out/gpu-check/<part>.log. No GPU has run this yet: bench/README.md says how to.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS_SCRIPT = Path(__file__).resolve().parent / "gpu_check_parts.py"
LOGS = ROOT / "bench-out" / "gpu-check"
OUT = ROOT / "bench-out" / "gpu-check.json"
RESULT_ENV, SECONDS_ENV = "GPU_CHECK_RESULT", "GPU_CHECK_SECONDS"
BUDGET_S = 470.0  # 7 min 50 s: the "under 8 minutes", with room for the report
MIN_PART_S = 20.0  # less than this left: a part would only start (python, torch) and be cut
GRACE_S = 10.0  # from SIGTERM to SIGKILL when a part is cut
CORE = ("msgspec", "numpy", "safetensors", "typer")  # what megacore imports at its top level
VERSIONS = ("transformers", "torchao", "flash-attn", "msgspec", "pytest")


@dataclass(frozen=True)
class Part:
    """A part: its name, its own timeout, the modules it needs and its command (None: the part of
    that name in gpu_check_parts.py)."""

    name: str
    timeout_s: float
    needs: tuple[str, ...] = ()
    cmd: tuple[str, ...] | None = None


# Small and essential first; the peers last, with what is left (they choose their models by it).
PARTS = (
    Part("cuda_tests", 120, (*CORE, "pytest", "transformers")),
    Part("fp8", 75, CORE),  # torchao is its own skip reason, with the GPU's capability
    Part("grouped_mm", 60, CORE),
    Part("cp_32k", 75, CORE),
    Part("peers", float("inf"), (*CORE, "transformers")),  # cut at the budget's end
)


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """The GPU (None without CUDA), torch and the packages the parts use, by version."""
    info = {"python": platform.python_version(), "gpu": None}
    info |= {"packages": {d: version(d) for d in VERSIONS}}
    try:
        import torch
    except ImportError:
        return {**info, "torch": None}
    info |= {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpus": torch.cuda.device_count(), "capability": f"{p.major}.{p.minor}"}
        info["memory_gib"] = round(p.total_memory / 2**30, 1)
    return info


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (a bench's own children too), then SIGKILL to whatever of
    it is left after GRACE_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_cut(cmd: list[str], timeout_s: float, log_path: Path, env: dict[str, str]) -> int | None:
    """Run `cmd` in a session of its own, output to `log_path`: its exit code, or None when it was
    cut at `timeout_s`."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return None


def last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()] if path.exists() else []
    return lines[-1].strip()[:500] if lines else "no output"


def outcome(rc: int | None, result: Path, log_path: Path, timeout_s: float) -> dict:
    """The part's record from its exit and what it wrote (kept when it was cut: the figures of what
    it finished)."""
    got = json.loads(result.read_text()) if result.is_file() else {}
    if rc is None:
        return {
            **got,
            "status": "failed",
            "timed_out": True,
            "reason": f"cut at its timeout, {timeout_s:.0f} s",
        }
    if rc != 0 or "status" not in got:  # an exception: its traceback ends the log
        return {**got, "status": "failed", "reason": f"exit {rc}: {last_line(log_path)}"}
    return got


def run_part(part: Part, left_s: float, logs: Path) -> dict:
    """One part, cut at its timeout or the budget's end: its record for the report."""
    if left_s < MIN_PART_S:
        return skipped(f"the total budget is spent ({max(left_s, 0):.0f} s left)")
    absent = [m for m in part.needs if importlib.util.find_spec(m) is None]
    if absent:
        return skipped(f"not installed: {', '.join(absent)} (carry the wheels: bench/README.md)")
    timeout = min(part.timeout_s, left_s)
    result, log_path = logs / f"{part.name}.json", logs / f"{part.name}.log"
    result.unlink(missing_ok=True)
    cmd = list(part.cmd) if part.cmd else [sys.executable, str(PARTS_SCRIPT), part.name]
    env = {**os.environ, RESULT_ENV: str(result), SECONDS_ENV: f"{timeout:.0f}", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    rc = run_cut(cmd, timeout, log_path, env)
    took = {"duration_s": round(time.monotonic() - t0, 1), "timeout_s": round(timeout, 1)}
    return {**outcome(rc, result, log_path, timeout), **took, "log": str(log_path)}


def run_parts(parts: tuple[Part, ...], budget_s: float, logs: Path) -> dict[str, dict]:
    """Every part in turn, inside one budget."""
    logs.mkdir(parents=True, exist_ok=True)
    deadline, records = time.monotonic() + budget_s, {}
    for part in parts:
        log(f"{part.name} ...")
        records[part.name] = record = run_part(part, deadline - time.monotonic(), logs)
        why = f": {record['reason']}" if record.get("reason") else ""
        log(f"{part.name}: {record['status']} ({record.get('duration_s', 0):.0f} s){why}")
    return records


def report(parts: tuple[Part, ...], budget_s: float, logs: Path) -> dict:
    """The whole check: the machine, then every part (each skipped without a CUDA device)."""
    t0, info = time.monotonic(), machine()
    if info["gpu"] is None:
        why = (
            "no CUDA device"
            if info["torch"]
            else f"no CUDA device: torch does not import in {sys.executable}"
        )
        records = {p.name: skipped(why) for p in parts}
    else:
        log(f"{info['gpu']}, torch {info['torch']}; budget {budget_s:.0f} s")
        records = run_parts(parts, budget_s, logs)
    peers = records.get("peers", {}).get("figures", {}).pop("rows", [])
    return {
        "kind": "gpu-check", "format_version": 1,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": info, "budget_s": budget_s, "duration_s": round(time.monotonic() - t0, 1),
        "summary": {s: sum(r["status"] == s for r in records.values()) for s in ("passed", "failed", "skipped")},
        "parts": records, "peers": peers,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help="the JSON report")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every part together")
    ap.add_argument("--only", nargs="+", choices=[p.name for p in PARTS], help="these parts alone")
    ap.add_argument("--logs", type=Path, default=LOGS, help="each part's output and result")
    args = ap.parse_args(argv)
    parts = tuple(p for p in PARTS if not args.only or p.name in args.only)
    rep = report(parts, args.budget, args.logs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rep, indent=1) + "\n")
    for name, r in rep["parts"].items():
        print(f"{name:<11} {r['status']:<8} {r.get('duration_s', 0):>5.0f} s  {r.get('reason', '')}")
    counts = ", ".join(f"{n} {s}" for s, n in rep["summary"].items())
    print(f"gpu-check: {counts} in {rep['duration_s']:.0f} s; report {args.out}")
    return 1 if rep["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
