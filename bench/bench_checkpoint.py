"""What checking a checkpoint's files as they are read costs (issue #20): mega-export and a training
job's load, with the check on (as shipped) against off; and what recording the per-piece sums
costs a training save.

Every reader of checkpoint tensors (`megacore.artifacts.tensors.TensorReader`) checks each file's
size the first time it opens it and hashes, on helper threads while the caller reads, converts and
writes, the bytes of each piece it reads (`Piece.sha256`); `confirm()` waits for the sums before
the output is committed or the load returns, so what is measured is what the hashing adds to the
wall time. Off is `megacore.artifacts.tensors.CHECK_SHA256 = False`, set in the measured child
process: the one switch, which only this benchmark touches (sizes are still checked). The save
row switches `megacore.checkpoint.PIECE_SHA256` the same way (the file's own sum is made either
way).

Two checkpoints, written random into bench-out/checkpoint/ as one file each (the tp1/pp1 layout of
mega-convert and of a one-rank training save; benchlib's `write_checkpoint`): bf16 weights, and bf16
weights + fp32 AdamW moments (10 bytes per parameter, a training checkpoint), Llama-2-7B tensor
shapes with one layer (`--quick`: small shapes). Measured, each in a fresh child process:
- export: `mega_export.export.export_hf` to bf16, of each checkpoint (of a training checkpoint only
  the weights' bytes are hashed: export reads nothing else);
- load: `megacore.parallel.checkpoint_io.load_checkpoint` of the training checkpoint into a one-process
  ParallelModel (gloo, fp32) and its AdamW state: what a resuming run does;
- save: `megacore.parallel.checkpoint_io.save_checkpoint` of that model and AdamW state (fp32 weights and
  moments, one process), piece sums recorded or not.
Rounds are paired and interleaved (benchlib's `paired_rounds`: on then off, then off then on,
...); the ratio is the median
over rounds of off / on in the same round (1.0: free; >= 0.91: at most 10% slower, the target), the
times shown each side's best. The page cache is warm (the files were just written): the check's CPU
cost in full; reading from a cold disk costs both sides the same read.
"""

from __future__ import annotations

import os
import shutil
import sys

from benchlib import (
    LLAMA2_7B,
    SMALL_DIMS,
    launch,
    logger,
    main,
    median_ratio,
    paired_rounds,
    write_checkpoint,
)
from benchlib import OUT as BENCH_OUT
from megacore.config import ModelConfig
from run import Row

OUT = BENCH_OUT / "checkpoint"
FULL_DIMS = {**LLAMA2_7B, "num_layers": 1}

EXPORT = """
import json, sys, time
import megacore.artifacts.tensors as tensors
tensors.CHECK_SHA256 = sys.argv[3] == "on"
from mega_export.export import export_hf
t = time.perf_counter()
export_hf(sys.argv[1], sys.argv[2], dtype="bfloat16", force=True, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""
LOAD = """
import json, sys, time
import torch
import megacore.artifacts.tensors as tensors
tensors.CHECK_SHA256 = sys.argv[2] == "on"
from megacore.artifacts import open_artifact
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from megacore.parallel.checkpoint_io import load_checkpoint
config = open_artifact(sys.argv[1], "checkpoint", verify="none").config
pm = ParallelModel(config, Parallelism(precision="fp32"), build_mesh(), "cpu")
opt = torch.optim.AdamW(pm.parameters())
t = time.perf_counter()
load_checkpoint(sys.argv[1], pm, opt)
seconds = time.perf_counter() - t
shutdown()
print(json.dumps({"seconds": seconds}))
"""
SAVE = """
import json, sys, time
import torch
import megacore.checkpoint as checkpoint
checkpoint.PIECE_SHA256 = sys.argv[3] == "on"
from megacore.artifacts import open_artifact
from megacore.artifacts.manifest import TrainingState
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from megacore.parallel.checkpoint_io import load_checkpoint, save_checkpoint
config = open_artifact(sys.argv[1], "checkpoint", verify="none").config
pm = ParallelModel(config, Parallelism(precision="fp32"), build_mesh(), "cpu")
opt = torch.optim.AdamW(pm.parameters())
load_checkpoint(sys.argv[1], pm, opt)
t = time.perf_counter()
save_checkpoint(sys.argv[2], pm, opt, TrainingState(step=1, optimizer="adamw"), force=True)
seconds = time.perf_counter() - t
shutdown()
print(json.dumps({"seconds": seconds}))
"""


log = logger("checkpoint")


def child(script: str, *args: object) -> float:
    """Seconds of the measured call, run in a fresh interpreter."""
    child = launch([sys.executable, "-c", script, *args], env={**os.environ, "OMP_NUM_THREADS": "1"})
    return child.result()["seconds"]


def paired(script: str, rounds: int, *args: object) -> dict[str, list[float]]:
    """`child(script, *args, side)` for side on and off, `rounds` paired rounds."""
    return paired_rounds(("on", "off"), rounds, lambda side, _: child(script, *args, side))


def row(metric: str, times: dict[str, list[float]], note: str, switch: str = "check") -> Row:
    ratio = median_ratio(times["off"], times["on"])
    rounds = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(times["on"], times["off"], strict=True))
    return Row(
        "checkpoint",
        metric,
        f"{switch} on {min(times['on']):.2f}s",
        f"off {min(times['off']):.2f}s",
        ratio,
        "<= 10% slower (ratio >= 0.91)",
        f"{note}; median of {len(times['on'])} paired rounds (on/off s: {rounds})",
    )


def run(quick: bool) -> list[Row]:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    dims, shape = (SMALL_DIMS, "quick sizes") if quick else (FULL_DIMS, "llama2-7b shapes, 1 layer")
    cfg = ModelConfig(family="llama", **dims)
    rounds = 2 if quick else 4
    rows = []
    for optim in (False, True):
        src = OUT / ("training" if optim else "weights")
        size = write_checkpoint(src, cfg, optim)
        what = "weights + AdamW state" if optim else "weights"
        note = f"{shape}, {what}, {size / 1e9:.2f} GB in one file"
        log(f"wrote {src.name}: {note}")
        times = paired(EXPORT, rounds, src, OUT / "hf")
        rows.append(row(f"export ({what}) wall", times, note))
        shutil.rmtree(OUT / "hf", ignore_errors=True)
        log(f"export of {src.name} done: {times}")
        if optim:
            times = paired(LOAD, rounds, src)
            rows.append(row("training load (load_checkpoint, 1 process) wall", times, note))
            log(f"load of {src.name} done: {times}")
            times = paired(SAVE, rounds, src, OUT / "saved")
            rows.append(row("training save (save_checkpoint, 1 process) wall", times, note, "piece sums"))
            shutil.rmtree(OUT / "saved", ignore_errors=True)
            log(f"save of {src.name} done: {times}")
    shutil.rmtree(OUT, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main(run)
