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
child process's ru_maxrss. The peak RSS target (< 1.5 GiB, whatever the model size) is checked: a
step above it fails the row and the run (exit 1). Each round trip is checked bit-exact (per-tensor
sha256, optimizer state included) after the timings. Disk: needs about 3.3x the checkpoint free; with
less the model is scaled down (fewer layers, same tensor shapes, so the same blocks) and the row says
so. `--quick`: small shapes, same two checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megacore.artifacts import TensorReader, open_artifact, whole, write_artifact
from megacore.artifacts.manifest import Layout, TrainingState
from megacore.checkpoint import CheckpointWriter, shard_file
from megacore.config import ModelConfig, model_tensors
from megacore.parallel.layout import optim_state_name
from run import Row

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out" / "shard"
BIN = Path(sys.executable).parent
LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008
)
QUICK = dict(
    vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, ffn_hidden_size=1408
)
BLOCK = 32 << 20
RSS_LIMIT = 1.5 * 2**30  # peak RSS target of every reshard step, checked
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")  # AdamW moments, fp32, one per parameter and kind


def log(msg: str) -> None:
    print(f"   shard: {msg}", file=sys.stderr, flush=True)


def source_tensors(cfg: ModelConfig, optim: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype): the bf16 weights, then (`optim`) each one's fp32 AdamW moments."""
    shapes = model_tensors(cfg)
    out = {n: (s, "bfloat16") for n, s in shapes.items()}
    if optim:
        out |= {optim_state_name(k, n): (s, "float32") for n, s in shapes.items() for k in OPTIM_KINDS}
    return out


def source_bytes(cfg: ModelConfig, optim: bool) -> int:
    return sum(math.prod(s) * (2 if d == "bfloat16" else 4) for s, d in source_tensors(cfg, optim).values())


def write_source(out: Path, cfg: ModelConfig, optim: bool) -> int:
    """Random weights and moments (random bits, streamed block by block), one piece per tensor."""
    tensors = source_tensors(cfg, optim)
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


# A small launcher process runs each measured command: a child forked from this (torch-sized)
# process would carry its resident pages into ru_maxrss until exec.
_LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), time.perf_counter() - t0, usage.ru_maxrss * 1024]))
"""


def measure(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one command, run by a small launcher process."""
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    code, seconds, rss = json.loads(out.stdout.strip().splitlines()[-1])
    if code:
        raise RuntimeError(f"{cmd} exited {code}: {out.stderr[-2000:]}")
    return seconds, rss


def cp_peer(src: Path, dst: Path) -> tuple[float, float, int]:
    """`cp -r` of the artifact, then `sync` of every copied file: (cp s, cp+sync s, cp peak RSS)."""
    shutil.rmtree(dst, ignore_errors=True)
    t_cp, rss = measure(["cp", "-r", str(src), str(dst)])
    t_sync, _ = measure(["sync", *map(str, sorted(dst.rglob("*")))])
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
    dims, note = (QUICK, "quick sizes") if quick else (dict(LLAMA2_7B), "llama2-7b shape")
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
    size = write_source(src, cfg, optim)
    log(f"{what}: wrote {size / 1e9:.2f} GB source in {time.perf_counter() - t0:.1f}s ({note})")
    rows: list[Row] = []
    for label, a, b, args in (
        ("tp1pp1->tp8pp4", src, mid, ["--tp", "8", "--pp", "4"]),
        ("tp8pp4->tp1pp1", mid, back, ["--tp", "1", "--pp", "1"]),
    ):
        t_cp, t_cp_sync, rss_cp = cp_peer(a, peer)
        t_ours, rss = measure([str(BIN / "mega-shard"), str(a), str(b), *args, "--force"])
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
