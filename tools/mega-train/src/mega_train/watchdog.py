"""The hang watchdog (`"watchdog": {"hang_s": 600}`): a silent hang turned into an exit a launcher
or a scheduler restarts from.

Each rank's training loop beats after every step, evaluation and save (`Watchdog.beat`); a daemon
thread publishes the rank's last beat (its step and when) to the job's key-value store (the
launcher's: torchrun's agent holds it, so a stopped rank does not take it down) every few seconds,
on a store client of its own. When this rank has not beaten for `hang_s` (a step stuck in a
collective, a rank stopped or deadlocked: every other rank then waits for it in the step's next
collective, and stops beating too), the thread:
- writes every thread's Python stack (`faulthandler`, which needs no lock and no GIL-holding
  Python code to have finished) to `out/hangs/<time>/rank-NNNNN.txt`, `<time>` the first firing
  rank's (agreed through the store), and on a GPU NCCL's flight recorder beside it when PyTorch
  records one (`TORCH_NCCL_TRACE_BUFFER_SIZE`);
- the first rank to fire names, in one line, the ranks that stopped progressing: those whose last
  published step is the lowest (a stopped rank publishes nothing more, so its record is the
  oldest);
- exits the process with `EXIT_HUNG`; torchrun's agent then stops the other workers (a rank that
  cannot run Python, stopped or stuck, is killed), and with `--max-restarts` starts them again.

What comes before the first step is not watched (building an index, a preference run's reference),
nor the first step (compiling); give `hang_s` more than the longest step, evaluation and synchronous
save.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

EXIT_HUNG = 3
PREFIX = "mega-train/watchdog"


class Watchdog:
    """One rank's watchdog (module docstring)."""

    def __init__(self, hang_s: float, out: Path, rank: int, world: int) -> None:
        self.hang_s, self.out, self.rank, self.world = hang_s, out, rank, world
        self.step, self.last = -1, time.monotonic()
        self.armed = False  # after the first beat
        self.store = dist.distributed_c10d._get_default_store().clone()
        self.period = min(5.0, hang_s / 4)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="mega-train-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int) -> None:
        """Progress: `step` is done (a step, its evaluation or its save)."""
        self.step, self.last, self.armed = step, time.monotonic(), True

    def close(self) -> None:
        """The run is over: the thread ends."""
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while True:
            step, last = self.step, self.last
            beat = time.time() - (time.monotonic() - last)
            try:
                self.store.set(f"{PREFIX}/rank-{self.rank}", f"{step} {beat:.3f} {time.time():.3f}")
            except Exception:  # the store gone with its launcher: lifecycle's watch ends this process
                return
            if self.armed and time.monotonic() - last > self.hang_s:
                self._fire(step)
            if self.done.wait(self.period):
                return

    def _fire(self, step: int) -> None:
        """Stacks, the line (the first rank to fire), exit (module docstring)."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        agreed = self.store.compare_set(f"{PREFIX}/fired", "", stamp).decode()
        where = self.out / "hangs" / agreed
        where.mkdir(parents=True, exist_ok=True)
        with open(where / f"rank-{self.rank:05d}.txt", "w") as f:
            f.write(f"rank {self.rank}: no progress for {self.hang_s:g} s after step {step}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        _nccl_trace(where / f"rank-{self.rank:05d}.nccl")
        if agreed == stamp:
            os.write(2, f"mega-train: error: {self._culprits()}; stacks in {where}\n".encode())
        os._exit(EXIT_HUNG)

    def _culprits(self) -> str:
        """Who stopped progressing: the ranks that no longer publish (stopped, dead, or stuck
        without letting Python run), else those of the lowest step, else every rank (a collective
        that never completed)."""
        now, seen = time.time(), {}
        for r in range(self.world):
            key = f"{PREFIX}/rank-{r}"
            seen[r] = (-1, 0.0)  # never published: as silent as a stopped rank
            if self.store.check([key]):  # a get would wait for the key
                step, _, published = self.store.get(key).decode().split()
                seen[r] = (int(step), float(published))
        silent = sorted(r for r, (_, p) in seen.items() if now - p > 3 * self.period)
        low = min(s for s, _ in seen.values())
        lowest = sorted(r for r, (s, _) in seen.items() if s == low)
        ranks = silent or lowest
        step = min(seen[r][0] for r in ranks)
        if len(ranks) == self.world > 1:
            return f"every rank stopped after step {step}: a collective that never completed (hang_s {self.hang_s:g})"
        names = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        why = "stopped responding" if silent else "stopped progressing"
        return f"{names} {why} after step {step} (no step for {self.hang_s:g} s: hang_s)"


def _nccl_trace(path: Path) -> None:
    """NCCL's flight recorder, where PyTorch keeps one (a GPU run with a trace buffer)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or not torch.cuda.is_available():
        return
    try:
        path.write_bytes(dump())
    except Exception:  # nothing recorded: nothing to add
        return
