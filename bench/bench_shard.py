"""mega-shard on a 7B-shaped checkpoint: peak memory and wall time against `cp` of the same bytes.

The benchmark writes a random bf16 Llama-2-7B-shaped checkpoint (about 13.5 GB, one file, the layout
mega-convert writes) into bench-out/shard/, then reshards tp1pp1 -> tp8pp4 -> tp1pp1 with the
installed `mega-shard` command. Each step's peer is `cp` of the step's input followed by `sync` of
the copies (mega-shard fsyncs what it writes, plain cp leaves dirty pages behind), timed side by side
in the same run. Peak RSS is the child process's ru_maxrss. The round trip is checked bit-exact
(per-tensor sha256) after the timings. Disk: needs about 3.3x the checkpoint free; with less the
model is scaled down (fewer layers) and the row says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megacore.artifacts import TensorReader, open_artifact, whole, write_artifact
from megacore.artifacts.manifest import Layout
from megacore.checkpoint import CheckpointWriter, shard_file
from megacore.config import ModelConfig, model_tensors
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


def log(msg: str) -> None:
    print(f"   shard: {msg}", file=sys.stderr, flush=True)


def write_source(out: Path, cfg: ModelConfig) -> int:
    """Random bf16 weights (random bits, streamed block by block), one piece per tensor."""
    shapes = model_tensors(cfg)
    rng = np.random.default_rng(0)
    with write_artifact(out, "checkpoint", force=True) as w:
        cw = CheckpointWriter(w)
        file = shard_file(0, 0)
        sw = cw.open_file(file, [(n, s, "bfloat16", whole(s)) for n, s in shapes.items()])
        for name, shape in shapes.items():
            left = int(np.prod(shape)) * 2
            while left:
                n = min(BLOCK, left)
                sw.write(name, torch.frombuffer(bytearray(rng.bytes(n)), dtype=torch.uint8))
                left -= n
        cw.close_file(file, sw)
        layout = Layout(stage_layers=[list(range(cfg.num_layers))])
        cw.commit(config=cfg, dtype="bfloat16", layout=layout, producer=("bench", "0"))
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
            h, rows = hashlib.sha256(), max(1, BLOCK // (int(np.prod(entry.shape[1:])) * 2))
            for r0 in range(0, entry.shape[0], rows):
                n = min(rows, entry.shape[0] - r0)
                box = ((r0, *[0] * (len(entry.shape) - 1)), (n, *entry.shape[1:]))
                h.update(r.read(name, entry, box).view(torch.uint8).numpy().data)
                r.close()
            out[name] = h.hexdigest()
    return out


def run(quick: bool) -> list[Row]:
    dims, note = (QUICK, "quick sizes") if quick else (dict(LLAMA2_7B), "llama2-7b shape")
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        shutil.rmtree(old, ignore_errors=True)
    bytes_per_layer = 2 * (4 * dims["hidden_size"] ** 2 + 3 * dims["hidden_size"] * dims["ffn_hidden_size"])
    free = shutil.disk_usage(OUT).free
    while not quick and 3.3 * bytes_per_layer * dims["num_layers"] > free and dims["num_layers"] > 4:
        dims["num_layers"] -= 4
        note = f"scaled to {dims['num_layers']} layers: {free / 1e9:.0f} GB free"
    cfg = ModelConfig(family="llama", **dims)
    src, mid, back, peer = OUT / "tp1pp1", OUT / "tp8pp4", OUT / "back-tp1pp1", OUT / "cp-copy"
    t0 = time.perf_counter()
    size = write_source(src, cfg)
    log(f"wrote {size / 1e9:.2f} GB source in {time.perf_counter() - t0:.1f}s ({note})")
    rows: list[Row] = []
    for label, a, b, args in (
        ("tp1pp1->tp8pp4", src, mid, ["--tp", "8", "--pp", "4"]),
        ("tp8pp4->tp1pp1", mid, back, ["--tp", "1", "--pp", "1"]),
    ):
        t_cp, t_cp_sync, rss_cp = cp_peer(a, peer)
        t_ours, rss = measure([str(BIN / "mega-shard"), str(a), str(b), *args, "--force"])
        log(
            f"{label}: mega-shard {t_ours:.1f}s peak RSS {rss / 2**20:.0f} MiB; cp {t_cp:.1f}s, cp+sync {t_cp_sync:.1f}s"
        )
        rows.append(
            Row("shard", f"{label} peak RSS", f"{rss / 2**30:.2f} GiB", f"model {size / 2**30:.1f} GiB",
                size / rss, "< 1.5 GiB", f"{note}; ratio = model bytes / our peak RSS; cp {rss_cp / 2**20:.0f} MiB")
        )  # fmt: skip
        rows.append(
            Row("shard", f"{label} wall", f"{t_ours:.1f}s", f"cp+sync {t_cp_sync:.1f}s (cp {t_cp:.1f}s)",
                t_cp_sync / t_ours, "ours <= 1.5x cp (ratio >= 0.67)", f"same {size / 1e9:.1f} GB")
        )  # fmt: skip
    same = tensor_hashes(src) == tensor_hashes(back)
    rows.append(Row("shard", "round trip bit-exact", str(same), "-", None, "True", "per-tensor sha256"))
    if not same:
        raise RuntimeError("the tp1pp1 -> tp8pp4 -> tp1pp1 round trip changed the tensors")
    for d in (src, mid, back):
        shutil.rmtree(d, ignore_errors=True)
    return rows
