"""A run's checkpoint saves (`Saver`): synchronous, or asynchronous (`"checkpoint": {"async": true}`).

A save is `megacore.parallel.checkpoint_io`'s two halves. Synchronous (the default on a CPU, where
the host copy would take from what training has), training waits for both. Asynchronous (the
default on a GPU), training waits only for the first, `snapshot`: the staging directory and each
rank's weights, moments and RNG state copied into host buffers (pinned on a GPU; made and touched in
the background after the first step, and reused: a rank holds one more copy of its state in host
memory); a background thread then writes the copies, and rank 0 commits the manifest only once
every rank's files are written (`write_snapshot`, collectives over a gloo group of their own, so
that they never interleave with training's), then points `latest` at it and prunes. At most one
save is in flight: the next one, the end of the run, a stop and a halt wait for it first. A crash
during the write leaves `step-N.partial/`, which resuming ignores.

Each save is a record in metrics.jsonl, `{"kind": "checkpoint", "step", "blocked_s", "write_s",
"bytes"}` (`blocked_s`: what training waited; `write_s`: the files and the manifest), reported when
it completes. A save that fails (a full disk, a permission: any rank's error) keeps nothing, is one
warning line and a record with its `error`, and training goes on: the next interval tries again.
`MAX_FAILED_SAVES` failures in a row end the run (exit 1, the newest checkpoint named): training on
with nowhere to resume from would put ever more work at risk.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mega_train import __version__
from mega_train.checkpoints import PRODUCER, point_latest, prune, resume_point, step_dir
from mega_train.metrics import say
from megacore.artifacts.manifest import TrainingState
from megacore.artifacts.reader import parent_of
from megacore.artifacts.writer import staging_dir
from megacore.errors import Silent, UserError
from megacore.parallel.checkpoint_io import SaveFailed, Snapshot, host_buffers, snapshot, write_snapshot
from megacore.parallel.mesh import device_type

if TYPE_CHECKING:
    from mega_train.trainer import Trainer

MAX_FAILED_SAVES = 3


class SavesFailing(UserError):
    """`MAX_FAILED_SAVES` saves in a row failed: the run stops, exit 1."""

    exit_code = 1


@dataclass
class Done:
    """A save's outcome, from the thread that wrote it."""

    step: int
    path: Path
    blocked_s: float
    write_s: float
    nbytes: int | None
    error: str | None


class Saver:
    """One rank's saves of a run (module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        spec = trainer.run.checkpoint.async_
        self.asynchronous = device_type() == "cuda" if spec == "auto" else spec
        self.group = dist.new_group(backend="gloo") if self.asynchronous else None
        self.buffers: dict[str, torch.Tensor] | None = {} if self.asynchronous else None
        self.thread: threading.Thread | None = None
        self.preparing: threading.Thread | None = None  # the host buffers, made in the background
        self.done: Done | None = None
        self.failed = 0  # saves failed in a row
        self.error = ""  # the last one's

    def prepare(self) -> None:
        """Asynchronous: make and touch the host buffers in the background, so that the first save
        blocks no longer than the next ones (once the moments exist: after a step)."""
        if self.buffers is None or self.buffers or self.preparing is not None:
            return
        t = self.t
        lora = t.plan.lora is not None

        def make() -> None:
            self.buffers.update(host_buffers(t.pm, t.opt, lora))

        self.preparing = threading.Thread(target=make, name="mega-train-buffers", daemon=True)
        self.preparing.start()

    def save(self) -> None:
        """A checkpoint of this step (collective): weights, moments, schedule, counters, RNG; in
        the background when asynchronous, once the save in flight is done."""
        if self.preparing is not None:
            self.preparing.join()
        self.wait()
        self._check_failures()
        t = self.t
        step, path = t.position.step, step_dir(t.plan.checkpoints, t.position.step)
        if t.saved_at == step:  # the save just waited for
            return
        if t.rank == 0 and t.stop is not None:  # a second Ctrl-C leaves no half-written step
            t.stop.on_abort = lambda: shutil.rmtree(staging_dir(path), ignore_errors=True)
        start = time.perf_counter()
        try:
            snap = self._snapshot(path)
        except SaveFailed as e:
            self.done = Done(step, path, time.perf_counter() - start, 0.0, None, str(e))
            self._finish()
            self._check_failures()
            return
        blocked = time.perf_counter() - start
        if self.asynchronous:
            args = (snap, step, path, blocked)
            self.thread = threading.Thread(target=self._write, args=args, name="mega-train-save", daemon=True)
            self.thread.start()
        else:
            self._write(snap, step, path, blocked)
            self.done.blocked_s += self.done.write_s  # training waited for the write too
            self._finish()
            self._check_failures()

    def _snapshot(self, path: Path) -> Snapshot:
        """This rank's part of the checkpoint (collective); a path in the way is the user's."""
        t, plan, pos = self.t, self.t.plan, self.t.position
        training = TrainingState(
            step=pos.step, consumed_samples=t.objective.consumed(pos.step), consumed_unit=plan.sample_unit,
            scheduler=t.schedule.saved(pos.step),
            optimizer="adamw", optimizer_steps=pos.optimizer_steps, loss_scale=t.scaler.scale,
            counters=dict(t.scaler.counters), fingerprint=plan.fingerprint,
            metrics={k: v for k, v in pos.metrics.items() if math.isfinite(v)},
        )  # fmt: skip
        try:
            return snapshot(
                path, t.pm, t.opt, training, producer=(PRODUCER, __version__), inputs=plan.inputs,
                rank_state={"cpu": torch.get_rng_state()}, tokenizer=plan.tokenizer,
                parents=[parent_of(p) for p in plan.inputs] if t.rank == 0 else [],
                license=plan.license, adapter=plan.lora.adapter(path) if plan.lora is not None else None,
                buffers=self.buffers,
            )  # fmt: skip
        except UserError:
            if t.rank != 0:
                raise Silent(2) from None
            raise UserError(
                f"cannot save step {pos.step}: {path} is in the way and is not a checkpoint this run can "
                "resume from; move it elsewhere and rerun to resume"
            ) from None

    def _write(self, snap: Snapshot, step: int, path: Path, blocked: float) -> None:
        """Write `snap` (collective over the saver's group); its outcome into `done`."""
        faults = self.t.faults
        start = time.perf_counter()
        nbytes, error = None, None
        try:
            if faults is not None:
                faults.around_write(step, "before")
            written = faults.in_save(step) if faults is not None else None
            nbytes = write_snapshot(snap, self.group, written)
            if faults is not None:
                faults.around_write(step, "after")
            if self.t.rank == 0:  # off the training path too: pruning removes gigabytes
                point_latest(self.t.plan.checkpoints, path)
                prune(self.t.plan.checkpoints, self.t.run.checkpoint.keep)
        except SaveFailed as e:
            error = str(e)
        except BaseException as e:  # a peer gone mid-write: no save, and nothing left to raise it in
            error = f"{type(e).__name__}: {e}"
        self.done = Done(step, path, blocked, time.perf_counter() - start, nbytes, error)

    def poll(self) -> None:
        """After a step: report the save in flight if it is done (nothing waits); the buffers'
        making started."""
        self.prepare()
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, and report it."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            self._finish()

    def _finish(self) -> None:
        """Report the save just done (`latest` and pruning were the writer's: rank 0's): a line and
        its record; or its failure (a line and the record). Nothing collective: `poll` calls it
        whenever a rank's thread is done."""
        done, self.done, t = self.done, None, self.t
        if t.stop is not None:
            t.stop.on_abort = None
        record = {
            "step": done.step, "kind": "checkpoint", "blocked_s": round(done.blocked_s, 4),
            "write_s": round(done.write_s, 4), "bytes": done.nbytes,
        }  # fmt: skip
        if done.error is None:
            self.failed = 0
            t.saved_at, t.last = done.step, done.path
            if t.rank == 0:
                say(f"mega-train: saved {done.path}")
            t.report(record)
            return
        self.failed += 1
        self.error = f"saving step {done.step} failed ({done.error})"
        t.report({**record, "error": done.error})
        if t.rank == 0 and self.failed < MAX_FAILED_SAVES:
            say(
                f"mega-train: warning: {self.error}; nothing of it is kept, training goes on and the next "
                "save tries again"
            )

    def _check_failures(self) -> None:
        """End the run after MAX_FAILED_SAVES failed saves in a row: every rank alike, in a save
        (where every rank has waited for the one in flight)."""
        if self.failed < MAX_FAILED_SAVES:
            return
        if self.t.rank != 0:
            raise Silent(SavesFailing.exit_code)
        last = resume_point(self.t.plan.checkpoints)[0]
        raise SavesFailing(
            f"{self.error}: {self.failed} saves in a row have failed; stopped, the last checkpoint is "
            f"{last[0] if last else 'none'}"
        )
