"""Where a run resumes from, and what it restores besides the weights, the moments, the schedule
and the loss scale (`Position`): the newest intact checkpoint of the run (`newest_intact`, on rank
0: newer damaged ones set aside, `latest` pointed at it), loaded on every rank with the damage any
rank found agreed on by all (`load_resumed`), so that every rank tries the next one alike.
`Trainer.resume` is the order of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mega_train.checkpoints import point_latest, resume_point, set_aside
from mega_train.metrics import say
from megacore.artifacts.manifest import CheckpointManifest
from megacore.errors import DamagedFile
from megacore.parallel.checkpoint_io import load_checkpoint, load_rank_state
from megacore.parallel.engine import ParallelModel


@dataclass
class Position:
    """How far the run is: what a checkpoint's `training` section restores besides the weights,
    the moments, the schedule and the loss scale."""

    step: int = 0
    optimizer_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last train_loss, valid_loss


def newest_intact(checkpoints: Path) -> tuple[Path, CheckpointManifest] | None:
    """Rank 0: the newest complete checkpoint that opens cleanly, newer damaged ones set aside,
    and `latest` pointing at it."""
    found, damaged = resume_point(checkpoints)
    for path, why in damaged:
        set_aside_damaged(path, why)
    if found is not None or damaged:
        point_latest(checkpoints, found[0] if found is not None else None)
    return found


def set_aside_damaged(path: Path, why: str) -> None:
    """Rank 0: a damaged checkpoint moved out of the way of the next resume, and said."""
    moved = set_aside(path)
    say(f"mega-train: warning: {path} is damaged ({why}); set aside as {moved.name}")


def load_resumed(
    path: Path,
    manifest: CheckpointManifest,
    pm: ParallelModel,
    opt: torch.optim.Optimizer,
    only: Callable[[str], bool] | None,
    device: torch.device | str,
) -> tuple[str | None, dict[str, torch.Tensor] | None]:
    """Load a checkpoint's slices (`only`: some of them) and this rank's RNG state on every rank
    (collective): the damage any rank found (its files are hashed as they are read), else None,
    the same on every rank; and this rank's RNG state."""
    damage, rng = "", None
    try:
        load_checkpoint(path, pm, opt, only=only)
        rng = load_rank_state(path, manifest)
    except DamagedFile as e:
        damage = str(e)
    flags = torch.tensor([1 if damage else 0], device=device)
    dist.all_reduce(flags)
    if not int(flags.item()):
        return None, rng
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, damage)
    return next(d for d in every if d), rng
