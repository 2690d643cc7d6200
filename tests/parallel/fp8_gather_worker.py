"""Worker for test_fp8_gather.py, under torchrun on gloo with 2 processes: precision fp8 at dp 2
(FSDP2, tensorwise scaling, torchao's emulation). Every Float8Linear must see, in its forward, its
whole weight as float8 data gathered by FSDP2, equal to the single-process weight rounded to
e4m3 with the tensorwise scale worked out here (448 / amax); the step's loss within FP8_REL of
the single-process fp32 loss; a checkpoint saved then (the weights are torchao's tensors inside
FSDP2's shards) holds the single-process weights bit for bit. Rank 0 prints "PASS <linears>"."""

from __future__ import annotations

import faulthandler
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from dist_worker import BATCH, FAMILIES, SEQ, load_state, reference_loss

from megacore.artifacts.run_spec import ParallelSpec
from megacore.checkpoint import CheckpointReader
from megacore.config import RouterLosses
from megacore.models import Decoder
from megacore.parallel import fp8
from megacore.parallel.checkpoint_io import save_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, init_distributed, shutdown

E4M3 = torch.float8_e4m3fn
FP8_REL = 0.01


def closed_form(weight: torch.Tensor) -> torch.Tensor:
    """A weight as tensorwise float8 holds it: scaled so its largest magnitude is e4m3's largest."""
    scale = (torch.finfo(E4M3).max / weight.abs().max().double()).float()
    return (weight * scale).clamp(-torch.finfo(E4M3).max, torch.finfo(E4M3).max).to(E4M3)


def _keep_weight(seen: dict, name: str, module: torch.nn.Module, args: tuple) -> None:
    """The float8 data of the weight FSDP2 hands the forward (a copy: FSDP2 frees its storage
    after the forward), or the weight's dtype where it is not float8."""
    data = getattr(module.weight, "_data", None)
    seen.setdefault(name, data.clone() if data is not None else module.weight.dtype)


def main() -> None:
    faulthandler.dump_traceback_later(300, exit=True)
    init_distributed()
    torch.manual_seed(1)
    cfg = FAMILIES["llama"]
    ref = Decoder(cfg, attention="sdpa")
    ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    emulate = fp8.float8_emulation("fp8_gather_worker")  # MEGA_FP8_EMULATE=1, set by the test
    par = Parallelism(
        ParallelSpec(), "fp8", 1, fp8_scaling="tensorwise", attention="sdpa", fp8_emulate=emulate
    )
    pm = ParallelModel(cfg, par, build_mesh(), "cpu")
    load_state(pm, state)
    seen: dict[str, torch.Tensor] = {}
    for part in pm.parts:
        for name, module in part.named_modules():
            if fp8.is_float8(module):
                module.register_forward_pre_hook(partial(_keep_weight, seen, name))
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    loss = pm.forward_backward(tokens[rows], targets[rows]).loss
    assert len(seen) == 7 * cfg.num_layers, sorted(seen)
    for name, data in seen.items():
        assert isinstance(data, torch.Tensor) and data.dtype == E4M3, (name, data)
        want = closed_form(state[f"{name}.weight"])
        assert data.shape == want.shape and torch.equal(data.view(torch.uint8), want.view(torch.uint8)), name
    dist.all_reduce(loss)
    want_loss = reference_loss(ref, cfg, RouterLosses(), tokens, targets).item()  # a dense model
    assert abs(loss.item() / 2 - want_loss) / want_loss < FP8_REL, (loss.item() / 2, want_loss)
    ckpt = Path(sys.argv[1])
    save_checkpoint(ckpt, pm)
    if rank == 0:
        with CheckpointReader(ckpt) as saved:
            for name, want in state.items():
                assert torch.equal(saved.read(name), want), name
        print("PASS", len(seen), flush=True)
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
