"""Context parallel: activation memory per rank and step time of one long sequence at cp 1, 2, 4.

A 125M Llama (hidden 768, 12 layers, 12 heads over 4 kv heads, ffn 2048, vocab 32,000; `--quick`:
4 layers) in fp32, one sequence of 4,096 tokens (`--quick`: 2,048), trained by the engine
(`ParallelModel.forward_backward`) under torchrun on gloo, 1 thread per process. The peer is the
same engine at cp 1: what one device would hold.

Activation memory is what autograd keeps for backward, counted exactly: the bytes of every distinct
storage saved during one step's forward (`saved_tensors_hooks`), parameters and their FSDP2
all-gathered copies left out, less what the same step saves for a sequence of 2 x cp tokens (the
weight-sized saves: the fused loss's weight gradient, 98 MB here, and the concatenated q/k/v and
gate/up weights, the same at any length). At cp > 1 it includes the keys and values gathered from
the other ranks and the chunks' masks. The target, from issue #23: at least 1.7x less per rank at cp 2 than at cp 1 (checked).
The sequence stands for "the longest that fits a fixed cap at cp 1": cp 1's activations at this
length are the cap, and cp 2 / cp 4 must hold that sequence in less.

Step time: cp 2 on 2 processes of 1 thread against cp 1 on one process of 2 threads, the same 2
cores, median of 3 steps after 1 warm-up; cp 1 and cp 2 interleaved over 2 rounds (`--quick`: 1;
benchlib's `paired_rounds`), median ratio. A goal to read (cp trades a kv all-gather per layer for
half the tokens per rank), not checked.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchlib import launch, median_ratio, paired_rounds
from run import Row

HERE = Path(__file__).resolve().parent
MODEL = dict(
    family="llama", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
    ffn_hidden_size=2048, max_seq_len=4096,
)  # fmt: skip
TARGET = 1.7


def worker(seq: int, layers: int, steps: int) -> None:
    """Under torchrun: one rank's activation bytes and step times; rank 0 prints them as JSON."""
    import torch
    import torch.distributed as dist

    from megacore.artifacts.run_spec import ParallelSpec
    from megacore.config import ModelConfig
    from megacore.parallel.engine import ParallelModel
    from megacore.parallel.layout import Parallelism
    from megacore.parallel.mesh import build_mesh, shutdown

    cp = int(os.environ["WORLD_SIZE"])
    config = ModelConfig(**{**MODEL, "num_layers": layers, "max_seq_len": seq})
    pm = ParallelModel(config, Parallelism(ParallelSpec(cp=cp), precision="fp32"), build_mesh(cp=cp), "cpu")
    pm.init_weights()
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    params = {p.data_ptr() for p in pm.parameters()}

    def saved_bytes(n: int) -> int:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not (t.is_leaf and t.requires_grad) and t.data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pm.forward_backward(tokens[:, :n], tokens[:, 1 : n + 1])
        return sum(saved.values())

    # What grows with the tokens: the weight-sized saves (the fused loss's weight gradient, the
    # concatenated q/k/v and gate/up weights) are the same for 2 x cp tokens and cancel out.
    activations = saved_bytes(seq) - saved_bytes(2 * cp)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        pm.forward_backward(tokens[:, :-1], tokens[:, 1:])
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(json.dumps({"activations": activations, "step_s": statistics.median(times)}), flush=True)
    shutdown()


def measure(cp: int, threads: int, seq: int, layers: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
    cmd += [__file__, "--worker", str(seq), str(layers), str(steps)]
    return launch(cmd, env=env, timeout=3600).result()


def run(quick: bool) -> list[Row]:
    seq, layers, rounds = (2048, 4, 1) if quick else (4096, 12, 2)
    shape = f"{layers} layers, seq {seq:,}"
    got = paired_rounds((1, 2), rounds, lambda cp, _: measure(cp, 2 if cp == 1 else 1, seq, layers, 3))
    acts = {cp: runs[-1]["activations"] for cp, runs in got.items()}
    ratio = median_ratio(*([m["step_s"] for m in got[cp]] for cp in (1, 2)))
    acts[4] = measure(4, 1, seq, layers, 1)["activations"]
    gib = 2**30
    rows = []
    for cp in (2, 4):
        ratio = acts[1] / acts[cp]
        target = TARGET if cp == 2 else None
        rows.append(Row(
            "context", f"activations per rank, cp {cp} vs cp 1 ({shape})",
            f"{acts[cp] / gib:.2f} GiB", f"{acts[1] / gib:.2f} GiB", ratio,
            f">= {TARGET}x" if target else "", "saved tensors, exact",
            None if target is None else ratio >= target,
        ))  # fmt: skip
    rows.append(Row(
        "context", f"step time, cp 2 (2 procs x 1 thread) vs cp 1 (1 x 2) ({shape})", "", "",
        ratio, "", f"{rounds} interleaved rounds",
    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, str(HERE))
        worker(*map(int, sys.argv[2:5]))
    else:
        for row in run("--quick" in sys.argv):
            print(row)
