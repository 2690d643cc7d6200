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
an hour, as a rank stuck in a collective would (the watchdog's test); `slow` makes a rank's update
take 50 ms longer from step N on, as a slow device would (the straggler report's test).

A fault may be scoped: `kind@N/rR` only on rank R (`nan-grad`, `fail-save`, `hang` and `slow` are
rank 0's unless scoped), `kind@N/sK` only in the job's K-th start of the workers (torchrun's
`TORCHELASTIC_RESTART_COUNT`, so that a restarted job does not meet the same fault again).
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
    "fail-save", "hang", "slow",
)  # fmt: skip
ONE_RANK = ("nan-grad", "fail-save", "hang", "slow")  # rank 0's unless scoped
SLOW_S = 0.05
ENV = "MEGA_TRAIN_INJECT"


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Faults:
    """The faults asked for this process (this rank, this start of the job), as (kind, step) pairs."""

    planned: frozenset[tuple[str, int]]

    @staticmethod
    def parse(spec: str | None, rank: int = 0, start: int = 0) -> Faults | None:
        """The faults `spec` asks for (`kind@step[/rR][/sK],...`) on `rank` in the job's `start`-th
        start of the workers, None for none."""
        planned = set()
        for item in filter(None, (spec or "").split(",")):
            kind, _, scoped = item.partition("@")
            step, *scopes = scoped.split("/")
            where = {"r": 0 if kind in ONE_RANK else rank, "s": start}
            for scope in scopes:
                if scope[:1] not in where or not scope[1:].isdigit():
                    raise UserError(f"{item!r}: a scope is /rRANK or /sSTART", ENV)
                where[scope[0]] = int(scope[1:])
            if kind not in KINDS or not step.isdigit():
                raise UserError(f"{item!r} is not one of {', '.join(KINDS)} @ a step", ENV)
            if (where["r"], where["s"]) == (rank, start):
                planned.add((kind, int(step)))
        return Faults(frozenset(planned)) if planned else None

    def at(self, kind: str, step: int) -> bool:
        return (kind, step) in self.planned

    def after_backward(self, step: int, loss, params: list):
        """Apply this step's faults between backward and the update; returns the (poisoned) loss."""
        if self.at("kill", step):
            _kill_self()
        if self.at("hang", step):
            time.sleep(3600)
        if loss is not None and self.at("nan-loss", step):
            loss = loss.new_full(loss.shape, float("nan"))
        if self.at("nan-grad", step):
            next(p for p in params if p.grad is not None).grad.fill_(float("nan"))
        return loss

    def in_save(self, step: int) -> Callable[[], None] | None:
        """What to run once a checkpoint's shard files are written (before its manifest)."""
        if self.at("stall-in-save", step):
            return lambda: time.sleep(60)
        if self.at("fail-save", step):
            return _disk_full
        return _kill_self if self.at("kill-in-save", step) else None

    def around_write(self, step: int, moment: str) -> None:
        """A save's `before` (its files) or `after` (its commit) moment: kill here if asked."""
        if self.at({"before": "kill-before-write", "after": "kill-after-commit"}[moment], step):
            _kill_self()

    def slow(self, step: int) -> None:
        """A slow device: `SLOW_S` more of this rank's own work in every step from the first `slow`."""
        if any(kind == "slow" and at <= step for kind, at in self.planned):
            end = time.perf_counter() + SLOW_S
            while time.perf_counter() < end:
                pass


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected)")
