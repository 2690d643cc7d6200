"""What a run reports: `metrics.jsonl` in the run directory (always), a console line every
`logging.every` steps, and the numbers behind them (tokens/s, TFLOP/s, MFU, memory).

metrics.jsonl holds one JSON object per line with `step` and `kind`: `train` (loss, lr, grad_norm,
tokens_per_s, tflops, mfu, skipped, nan_steps, loss_scale, memory_gb, step_time_s, compile_s: the
seconds of the step torch.compile took, which tokens/s, TFLOP/s and MFU leave out), `eval` (loss,
ppl, accuracy and the user's `eval.metrics`: `evaluation.py`), `eval_task` (task, metric, value: an
lm-eval score, `harness.py`) or `sample` (prompt, completion: `sampling.py`). A resumed run first drops the lines
after the step it resumes from, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from megacore.artifacts.writer import write_file_atomic

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (vendor datasheets), matched against the device name.
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "V100": 125.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def peak_tflops(given: float | None, precision: str) -> float | None:
    """`--peak-tflops`, else the table's entry for this GPU in bf16/fp16; None (no MFU) otherwise."""
    if given is not None:
        return given
    if precision == "fp32" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far, as dynamo's own timers count them:
    the forward graphs' compiles and the backward graphs' (compiled in the first backward). 0
    where a torch version names its timers otherwise: tokens/s then includes the compile."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(
        sum(compilation_time_metrics.get(k, ()))
        for k in ("_compile.compile_inner", "backward._backward_impl")
    )


def memory_gb() -> float:
    """Peak memory of this process: the accelerator's allocated peak, else the peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # kB on Linux


class MetricsLog:
    """Appends records to `<out>/metrics.jsonl`, flushed per line (a crash keeps what was logged)."""

    def __init__(self, out: Path, resume_step: int | None) -> None:
        self.path = out / "metrics.jsonl"
        if resume_step is not None and self.path.is_file():
            kept = [
                line
                for line in self.path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            write_file_atomic(self.path, "".join(kept).encode())
        elif resume_step is None:
            self.path.unlink(missing_ok=True)  # a fresh run in a run directory of ours
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the whole run)

    def write(self, record: dict) -> None:
        """One line; a NaN or infinite value is written as null (JSON has no NaN)."""
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train_line(r: dict, total_steps: int) -> str:
    """The console line of a `train` record."""
    parts = [
        f"step {r['step']}/{total_steps}",
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.3g}",
        f"grad norm {r['grad_norm']:.3g}",
        f"{r['tokens_per_s']:,.0f} tok/s",
        *([f"compiled in {r['compile_s']:.1f}s"] if r.get("compile_s", 0) >= 0.1 else []),
        f"{r['tflops']:.3g} TFLOP/s",
    ]
    if r["mfu"] is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "aux_loss" in r:
        parts.append(f"aux loss {r['aux_loss']:.4f}")
        parts.append(
            f"expert load {r['expert_load_min']:.0f}-{r['expert_load_max']:.0f} cv {r['expert_load_cv']:.2f}"
        )
    if "reward" in r:  # online RL (TRL's names)
        parts.append(f"reward {r['reward']:.4g} ± {r['reward_std']:.3g}")
    if "rewards/accuracies" in r:  # a preference objective (TRL's names)
        parts.append(f"reward acc {r['rewards/accuracies']:.3f} margin {r['rewards/margins']:.4g}")
    parts.append(f"mem {r['memory_gb']:.2f} GB")
    if r["loss_scale"] is not None:
        parts.append(f"loss scale {r['loss_scale']:g}")
    if r["skipped"]:
        parts.append(f"skipped {r['skipped']}")
    return " | ".join(parts)


def eval_line(r: dict) -> str:
    """The console line of an `eval` record: loss, perplexity, accuracy, then the user's metrics
    (a preference objective's: loss, then TRL's metrics; online RL's: its rewards, no loss)."""
    parts = [f"step {r['step']} eval", *([f"loss {r['loss']:.4f}"] if "loss" in r else [])]
    parts += [f"ppl {r['ppl']:.2f}"] if "ppl" in r else []  # a preference objective has none
    parts += [f"{k} {v:.4g}" for k, v in r.items() if k not in ("step", "kind", "loss", "ppl")]
    return " | ".join(parts)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def say(message: str) -> None:
    """A console line on stdout; on a terminal it first clears the progress line on stderr."""
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    print(message, flush=True)
