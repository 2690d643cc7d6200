"""Run under torchrun (gloo, 2 processes): `save_worker.py OUT`. The tiny model split over tp 2, one
AdamW step, saved by `save_checkpoint`: a training checkpoint whose rank 0 commits the pieces both
ranks recorded (test_damage.py checks their sums)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from helpers import TINY
from megacore.artifacts.manifest import TrainingState
from megacore.artifacts.run_spec import ParallelSpec
from megacore.parallel.checkpoint_io import save_checkpoint
from megacore.parallel.dims import Parallelism
from megacore.parallel.engine import ParallelModel
from megacore.parallel.mesh import build_mesh, shutdown


def main(out: Path) -> None:
    torch.manual_seed(0)
    pm = ParallelModel(TINY, Parallelism(ParallelSpec(tp=2), precision="fp32"), build_mesh(tp=2), "cpu")
    opt = torch.optim.AdamW(pm.parameters())
    for p in pm.parameters():
        p.grad = torch.ones_like(p)  # any gradient: the moments only need to exist and differ
    opt.step()
    save_checkpoint(out, pm, opt, TrainingState(step=1, optimizer="adamw"))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
