"""mega-shard on a 7B-shaped checkpoint: peak memory and wall time against `cp` of the same bytes.

Two checkpoints, one after the other, each written random into bench-out/shard/ as one file (the
layout mega-convert and a tp1/pp1 training save write), then resharded tp1pp1 -> tp8pp4 -> tp1pp1
with the installed `mega-shard` command:
- weights: bf16 Llama-2-7B shapes (about 13.5 GB);
- weights + AdamW state: the same bf16 weights plus each parameter's fp32 moments
  `optim.exp_avg.<name>` and `optim.exp_avg_sq.<name>` (same shapes; mega-shard reshards them like
  their parameter), 10 bytes per parameter: a 7B training checkpoint is about 67 GB.
Each step's peer is `cp` of the step's input followed by `sync` of the copies (mega-shard fsyncs what
it writes, plain cp leaves dirty pages behind), timed side by side in the same run. Peak RSS is the
child process's own (benchlib's `launch`). The peak RSS target (< 1.5 GiB, whatever the model
size) is checked: a step above it fails the row and the run (exit 1). Each round trip is checked
bit-exact (per-tensor sha256, optimizer state included) after the timings. Disk: needs about 3.3x
the checkpoint free; with less the model is scaled down (fewer layers, same tensor shapes, so the
same blocks) and the row says so. `--quick`: small shapes, same two checkpoints. The checkpoints:
benchlib's `write_checkpoint`.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from pathlib import Path

import torch

from benchlib import (
    BLOCK,
    LLAMA2_7B,
    SMALL_DIMS,
    checkpoint_tensors,
    launch,
    logger,
    tool_command,
    write_checkpoint,
)
from benchlib import OUT as BENCH_OUT
from megacore.artifacts import TensorReader, open_artifact
from megacore.config import ModelConfig
from run import Row

OUT = BENCH_OUT / "shard"
RSS_LIMIT = 1.5 * 2**30  # peak RSS target of every reshard step, checked
log = logger("shard")


def source_bytes(cfg: ModelConfig, optim: bool) -> int:
    return sum(
        math.prod(s) * (2 if d == "bfloat16" else 4) for s, d in checkpoint_tensors(cfg, optim).values()
    )


def measure(cmd: list[object]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one command."""
    child = launch(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).ok()
    return child.seconds, child.rss


def cp_peer(src: Path, dst: Path) -> tuple[float, float, int]:
    """`cp -r` of the artifact, then `sync` of every copied file: (cp s, cp+sync s, cp peak RSS)."""
    shutil.rmtree(dst, ignore_errors=True)
    t_cp, rss = measure(["cp", "-r", src, dst])
    t_sync, _ = measure(["sync", *sorted(dst.rglob("*"))])
    shutil.rmtree(dst)
    return t_cp, t_cp + t_sync, rss


def tensor_hashes(path: Path) -> dict[str, str]:
    m = open_artifact(path, "checkpoint", verify="size")
    out = {}
    with TensorReader(path) as r:
        for name, entry in m.tensors.items():
            row_bytes = math.prod(entry.shape[1:]) * getattr(torch, entry.dtype).itemsize
            h, rows = hashlib.sha256(), max(1, BLOCK // row_bytes)
            for r0 in range(0, entry.shape[0], rows):
                n = min(rows, entry.shape[0] - r0)
                box = ((r0, *[0] * (len(entry.shape) - 1)), (n, *entry.shape[1:]))
                h.update(r.read(name, entry, box).view(torch.uint8).numpy().data)
                r.close()
            out[name] = h.hexdigest()
    return out


def run(quick: bool) -> list[Row]:
    OUT.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for optim in (False, True):
        rows += reshard_case(quick, optim)
    return rows


def reshard_case(quick: bool, optim: bool) -> list[Row]:
    """tp1pp1 -> tp8pp4 -> tp1pp1 of one checkpoint (weights, or weights + AdamW state)."""
    for old in OUT.iterdir():
        shutil.rmtree(old, ignore_errors=True)
    what = "weights + AdamW state" if optim else "weights"
    dims, note = (SMALL_DIMS, "quick sizes") if quick else (dict(LLAMA2_7B), "llama2-7b shape")
    free = shutil.disk_usage(OUT).free
    while not quick and 3.3 * source_bytes(ModelConfig(family="llama", **dims), optim) > free:
        if dims["num_layers"] <= 4:  # pp 4 needs 4 layers: say so rather than fill the disk
            need = 3.3 * source_bytes(ModelConfig(family="llama", **dims), optim)
            why = f"skipped: {free / 1e9:.0f} GB free, 4 layers need {need / 1e9:.0f} GB"
            return [Row("shard", f"{what} reshard", "-", "-", None, "", why)]
        dims["num_layers"] -= 4
        note = f"scaled to {dims['num_layers']} layers: {free / 1e9:.0f} GB free"
    cfg = ModelConfig(family="llama", **dims)
    src, mid, back, peer = OUT / "tp1pp1", OUT / "tp8pp4", OUT / "back-tp1pp1", OUT / "cp-copy"
    t0 = time.perf_counter()
    size = write_checkpoint(src, cfg, optim)
    log(f"{what}: wrote {size / 1e9:.2f} GB source in {time.perf_counter() - t0:.1f}s ({note})")
    rows: list[Row] = []
    for label, a, b, args in (
        ("tp1pp1->tp8pp4", src, mid, ["--tp", "8", "--pp", "4"]),
        ("tp8pp4->tp1pp1", mid, back, ["--tp", "1", "--pp", "1"]),
    ):
        t_cp, t_cp_sync, rss_cp = cp_peer(a, peer)
        t_ours, rss = measure([*tool_command("mega-shard"), a, b, *args, "--force"])
        log(
            f"{what} {label}: mega-shard {t_ours:.1f}s peak RSS {rss / 2**20:.0f} MiB; cp {t_cp:.1f}s, "
            f"cp+sync {t_cp_sync:.1f}s"
        )
        rows.append(
            Row("shard", f"{what} {label} peak RSS", f"{rss / 2**30:.2f} GiB", f"checkpoint {size / 2**30:.1f} GiB",
                size / rss, f"< {RSS_LIMIT / 2**30:.1f} GiB",
                f"{note}; ratio = checkpoint bytes / our peak RSS; cp {rss_cp / 2**20:.0f} MiB",
                passed=rss < RSS_LIMIT)
        )  # fmt: skip
        rows.append(
            Row("shard", f"{what} {label} wall", f"{t_ours:.1f}s", f"cp+sync {t_cp_sync:.1f}s (cp {t_cp:.1f}s)",
                t_cp_sync / t_ours, "ours <= 1.5x cp (ratio >= 0.67)", f"same {size / 1e9:.1f} GB")
        )  # fmt: skip
    a, b = tensor_hashes(src), tensor_hashes(back)
    moments = sum(n.startswith("optim.") for n in a)
    same = a == b
    rows.append(
        Row("shard", f"{what} round trip bit-exact", str(same), "-", None, "True",
            f"per-tensor sha256 of {len(a)} tensors ({moments} optimizer moments)", passed=same)
    )  # fmt: skip
    for d in (src, mid, back):
        shutil.rmtree(d, ignore_errors=True)
    return rows
