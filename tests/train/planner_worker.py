"""Worker for the planner's state test, run under torchrun on gloo: `planner_worker.py SCENARIOS_JSON`.

For each scenario every rank builds the engine's `ParallelModel`, runs one step (forward_backward
and mega-train's fused AdamW, `make_optimizer`) and reports what it holds: the local bytes
(`to_local()` of DTensors) of its parameters, gradients, optimizer state tensors and compute
copies, beside `megacore.planner`'s numbers for its pp/dp/cp coordinates and the rows of
`estimate` that list the rank. A scenario with "measure" then measures two more steps (`measure`).
Rank 0 prints one `RESULT {json}` line per scenario, every rank's figures in it; the test
(tests/train/test_planner.py) compares them, so a failure names the scenario and its numbers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from mega_train.optimizer import make_optimizer
from megacore import planner
from megacore.artifacts.run_spec import OptimizerSpec, ParallelSpec
from megacore.config import LoRA, ModelConfig
from megacore.models import adapters
from megacore.models.nf4 import is_nf4
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown

# Tiny Llama: GQA (kv heads replicated under tp 4), vocab 400 padded to 512.
TINY = dict(
    family="llama", vocab_size=400, padded_vocab_size=512, hidden_size=32, num_layers=4, num_heads=4,
    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=64,
)  # fmt: skip
MICRO, SEQ = 2, 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def local_bytes(t: torch.Tensor | None) -> int:
    """The bytes of a tensor's local piece: an NF4 tensor's codes, scales, factors, their mean and its
    code table (its inner tensors, as torchao flattens it), a plain one's elements."""
    if t is None:  # a frozen parameter's gradient (LoRA)
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    if is_nf4(local):
        return sum(getattr(local, name).nbytes for name in local.__tensor_flatten__()[0])
    return local.numel() * local.element_size()


def held(pm: ParallelModel, opt: torch.optim.Optimizer) -> planner.State:
    """What the rank holds after a step: parameters, gradients, optimizer state and compute copies."""
    params = list(pm.parameters())  # a tied output copy too
    state = [t for p in params if p in opt.state for t in opt.state[p].values() if torch.is_tensor(t)]
    copies = [c for cc in pm.copies for _, c in cc.pairs]
    return planner.State(
        weights=sum(local_bytes(p) for p in params),
        grads=sum(local_bytes(p.grad) for p in params),
        optimizer=sum(local_bytes(t) for t in state),
        copies=sum(local_bytes(c) for c in copies),
    )


def saved_bytes(pm: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes of the tensors autograd saves in a step's forward (their storages, each once: views
    share), but parameters and views of them (FSDP2's unsharded ones: state, which the planner
    counts apart, and freed after the forward). What a backward saves while it recomputes (linear
    attention's delta rule, one layer at a time) is transient: the planner counts it in the buffers."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # inside the backward
            return t
        if isinstance(t._base if t._base is not None else t, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.forward_backward(x, y)
    return sum(storages.values())


def step_peak(pm: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> int:
    """The peak increase of the CPU allocator's live bytes in a step (test_planner.measured_peak)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.forward_backward(x, y)
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(
    pm: ParallelModel, cfg: ModelConfig, par: Parallelism, dp: int, x: torch.Tensor, seq: int
) -> dict[str, int]:
    """A step's saved tensors (`saved_bytes`) and its peak (`step_peak`) beside the planner's
    `rank_activations` and `rank_buffers` (the test holds the former to the saved tensors, their
    sum to the peak). One microbatch (the next one's saved tensors could reuse its storages), no
    pipeline, recompute none."""
    assert par.microbatches == 1 and par.spec.pp == 1 and par.recompute == "none", par
    return {
        "activations": planner.rank_activations(cfg, par, 0, x.shape[0], seq),
        "buffers": planner.rank_buffers(cfg, par, dp, 0, x.shape[0], seq),
        "saved": saved_bytes(pm, x[:, :-1], x[:, 1:]),
        "peak": step_peak(pm, x[:, :-1], x[:, 1:]),
    }


def run(sc: dict) -> dict:
    cfg = msgspec.convert({**TINY, **sc.get("config", {})}, ModelConfig)
    spec = ParallelSpec(
        tp=sc.get("tp", 1),
        pp=sc.get("pp", 1),
        cp=sc.get("cp", 1),
        schedule=sc.get("schedule", "1f1b"),
        virtual_stages=sc.get("virtual_stages", 1),
        dp_mode=sc.get("dp_mode", "fsdp"),
        sequence_parallel=sc.get("sp", False),
        ep=sc.get("ep", 1),
    )
    mesh = build_mesh(spec.tp, spec.pp, spec.cp, spec.ep)
    dp, pp_rank = mesh["dp"].size(), mesh["pp"].get_local_rank()
    # The rank's place in FSDP2's dp x cp mesh (flattened, dp outer: `ParallelModel`).
    replica = mesh["dp"].get_local_rank() * spec.cp + mesh["cp"].get_local_rank()
    seq = sc.get("seq", SEQ)
    m = sc.get("microbatches", 2)
    lora = None
    if sc.get("lora"):  # adapters on every projection (QLoRA: "nf4"), as the run plan resolves them
        lora = LoRA(4, 8.0, PROJECTIONS, base_dtype=sc.get("base_dtype"))
        lora = dataclasses.replace(lora, modules=tuple(adapters.modules(cfg, lora.targets)))
    par = Parallelism(spec, sc.get("precision", "fp32"), m, False, "none", attention="sdpa", lora=lora)
    pm = ParallelModel(cfg, par, mesh, "cpu")
    pm.init_weights()
    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad], OptimizerSpec())
    x = torch.randint(0, cfg.vocab_size, (MICRO * m, seq + 1), generator=torch.Generator().manual_seed(0))
    pm.forward_backward(x[:, :-1] if pm.has_first else None, x[:, 1:] if pm.has_last else None)
    opt.step()

    rank = dist.get_rank()
    figures = {
        "rank": rank,
        "held": dataclasses.asdict(held(pm, opt)),
        "planned": dataclasses.asdict(planner.rank_state(cfg, par, dp, pp_rank, replica)),
        # Every row of the estimate that names this rank (the test wants exactly one, as held).
        "listed": [
            dataclasses.asdict(planner.State(r.weights, r.grads, r.optimizer, r.copies))
            for r in planner.estimate(cfg, par, dp, MICRO, seq)
            if rank in r.ranks
        ],
    }
    if sc.get("measure"):
        figures["measured"] = measure(pm, cfg, par, dp, x, seq)
    return figures


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    for sc in scenarios:
        figures = run(sc)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, figures)
        if dist.get_rank() == 0:
            print("RESULT", json.dumps({"scenario": sc, "ranks": ranks}), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
