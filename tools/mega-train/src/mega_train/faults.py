"""Fault injection for tests: `MEGA_TRAIN_INJECT="nan-grad@3,nan-loss@5,kill@7,kill-in-save@4"`.

Parsed once by the CLI (`Faults.parse`, the variable read through `megacore.env`) and handed to the
trainer as an argument; a run without it holds None and never looks again. At step N
(counted from 1, the step that just ran): `nan-grad` poisons a gradient on rank 0, `nan-loss` the
loss; `kill` SIGKILLs the job in the middle of the step (after backward, before the update);
`kill-in-save` in the middle of writing that step's checkpoint (after the shard files, before the
manifest); `stall-in-save` waits there for a minute (time for a test to interrupt a save);
`kill-before-write` once the save's snapshot is taken, before any file is written, and
`kill-after-commit` once its manifest is committed, before `latest` points at it (the moments of an
asynchronous save's background write, on every rank); `fail-save` makes that step's save fail as a
full disk would (rank 0's write raises ENOSPC); `hang` stops rank 0 in the middle of the step for
an hour, as a rank stuck in a collective would (the watchdog's test).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from megacore.errors import UserError

KINDS = (
    "nan-grad", "nan-loss", "kill", "kill-in-save", "stall-in-save", "kill-before-write", "kill-after-commit",
    "fail-save", "hang",
)  # fmt: skip
ENV = "MEGA_TRAIN_INJECT"


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Faults:
    """The faults asked for, as (kind, step) pairs."""

    planned: frozenset[tuple[str, int]]

    @staticmethod
    def parse(spec: str | None) -> Faults | None:
        """The faults `spec` asks for (`kind@step,...`), None for none."""
        planned = set()
        for item in filter(None, (spec or "").split(",")):
            kind, _, step = item.partition("@")
            if kind not in KINDS or not step.isdigit():
                raise UserError(f"{item!r} is not one of {', '.join(KINDS)} @ a step", ENV)
            planned.add((kind, int(step)))
        return Faults(frozenset(planned)) if planned else None

    def at(self, kind: str, step: int) -> bool:
        return (kind, step) in self.planned

    def after_backward(self, step: int, loss, params: list, rank: int):
        """Apply this step's faults between backward and the update; returns the (poisoned) loss."""
        if self.at("kill", step):
            _kill_self()
        if rank == 0 and self.at("hang", step):
            time.sleep(3600)
        if loss is not None and self.at("nan-loss", step):
            loss = loss.new_full(loss.shape, float("nan"))
        if rank == 0 and self.at("nan-grad", step):
            next(p for p in params if p.grad is not None).grad.fill_(float("nan"))
        return loss

    def in_save(self, step: int, rank: int = 0) -> Callable[[], None] | None:
        """What to run once a checkpoint's shard files are written (before its manifest)."""
        if self.at("stall-in-save", step):
            return lambda: time.sleep(60)
        if rank == 0 and self.at("fail-save", step):
            return _disk_full
        return _kill_self if self.at("kill-in-save", step) else None

    def around_write(self, step: int, moment: str) -> None:
        """A save's `before` (its files) or `after` (its commit) moment: kill here if asked."""
        if self.at({"before": "kill-before-write", "after": "kill-after-commit"}[moment], step):
            _kill_self()


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected)")
