"""Worker for the planner's state test, run under torchrun on gloo: `planner_worker.py SCENARIOS_JSON`.

For each scenario every rank builds the engine's `ParallelModel`, runs one step (forward_backward
and mega-train's fused AdamW, `make_optimizer`), sums the local bytes (`to_local()` of DTensors)
of its parameters, gradients, optimizer state tensors and compute copies, and asserts them equal
to `megacore.parallel.memory`'s numbers for its pp/dp coordinates, and that `estimate` lists the
rank under those numbers. Rank 0 prints one PASS line per scenario.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mega_train.trainer import make_optimizer
from megacore.artifacts.manifest import OptimizerSpec, ParallelSpec
from megacore.config import ModelConfig
from megacore.parallel import memory
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown

# Tiny Llama: GQA (kv heads replicated under tp 4), vocab 400 padded to 512.
TINY = dict(
    family="llama", vocab_size=400, padded_vocab_size=512, hidden_size=32, num_layers=4, num_heads=4,
    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=64,
)  # fmt: skip
MICRO, SEQ = 2, 16


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held(pm: ParallelModel, opt: torch.optim.Optimizer) -> memory.State:
    """What the rank holds after a step: parameters, gradients, optimizer state and compute copies."""
    params = list(pm.parameters())  # a tied output copy too
    state = [t for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
    copies = [c for cc in pm.copies for _, c in cc.pairs]
    return memory.State(
        weights=sum(local_bytes(p) for p in params),
        grads=sum(local_bytes(p.grad) for p in params),
        optimizer=sum(local_bytes(t) for t in state),
        copies=sum(local_bytes(c) for c in copies),
    )


def run(sc: dict) -> str:
    cfg = ModelConfig(**{**TINY, **sc.get("config", {})})
    spec = ParallelSpec(
        tp=sc.get("tp", 1),
        pp=sc.get("pp", 1),
        schedule=sc.get("schedule", "1f1b"),
        virtual_stages=sc.get("virtual_stages", 1),
        dp_mode=sc.get("dp_mode", "fsdp"),
        sequence_parallel=sc.get("sp", False),
    )
    mesh = build_mesh(spec.tp, spec.pp)
    dp, pp_rank, dp_rank = mesh["dp"].size(), mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    m = sc.get("microbatches", 2)
    par = Parallelism(spec, sc.get("precision", "fp32"), m, False, "none")
    pm = ParallelModel(cfg, par, mesh, "cpu")
    for part in pm.parts:
        part.set_attention("sdpa")
    pm.init_weights()
    opt = make_optimizer(list(pm.parameters()), OptimizerSpec())
    x = torch.randint(0, cfg.vocab_size, (MICRO * m, SEQ + 1), generator=torch.Generator().manual_seed(0))
    pm.forward_backward(x[:, :-1] if pm.has_first else None, x[:, 1:] if pm.has_last else None)
    opt.step()

    got = held(pm, opt)
    want = memory.rank_state(cfg, par, dp, pp_rank, dp_rank)
    rank = dist.get_rank()
    assert got == want, (sc, rank, got, want)
    rows = [r for r in memory.estimate(cfg, par, dp, MICRO, SEQ) if rank in r.ranks]
    assert (
        len(rows) == 1
        and memory.State(rows[0].weights, rows[0].grads, rows[0].optimizer, rows[0].copies) == got
    )
    return f"PASS {json.dumps(sc)} rank {rank}: {got}"


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    for sc in scenarios:
        line = run(sc)
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, line)
        if dist.get_rank() == 0:
            print(json.dumps(sc), "PASS on", len(lines), "ranks", flush=True)
            for one in lines:
                print("  ", one, flush=True)
    shutdown()


if __name__ == "__main__":
    main()
