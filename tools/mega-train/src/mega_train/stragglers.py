"""Stragglers: each rank's own work per step, gathered at log steps, and a slow rank named.

A step's wall time is the same on every rank (each collective waits for the slowest rank), so it
cannot tell which rank is slow. What differs is the work no collective holds up: reading the step's
batch and the optimizer's update (after the gradients are reduced and clipped). Each rank times
that work every step (the batch on the host clock; the update by CUDA events on a GPU, the host
clock on a CPU) and keeps the times; at every `flush` (the log steps) the ranks gather them in one
all-reduce (each rank fills its row), the only collective this adds (on a GPU once the last
update's end event is reached, as the flush's read would wait for it anyway), and rank 0 reads
them back with the step's other values, in the flush's one read. Rank 0 puts each step's times into its train record as
`rank_local_s` (one number per rank) and names on the console every rank whose mean over the
interval (its median step: one step held up by the host is no straggler) is more than `FACTOR`
times its peers' median and `MIN_EXCESS_S` above it (nor are milliseconds of scheduling noise). Its peers are the ranks of its pipeline stage
where there are several (stages hold different layers, so their updates differ), else all others.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

FACTOR = 1.5
MIN_EXCESS_S = 0.005


class OwnWork:
    """One rank's own work per step (module docstring): `host` and `update` time it, `end_step`
    closes a step, `gather` brings every rank's steps since the last gather."""

    def __init__(self, device: torch.device | str, stage: int) -> None:
        self.device, self.stage = torch.device(device), stage
        self.gpu = self.device.type == "cuda"
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.steps: list[tuple[float, list]] = []

    @contextmanager
    def host(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._host += time.perf_counter() - start

    @contextmanager
    def update(self) -> Iterator[None]:
        """The optimizer's update: on a GPU its kernels' time, read at the next gather."""
        if not self.gpu:
            with self.host():
                yield
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._events.append((begin, end))

    def end_step(self) -> None:
        self.steps.append((self._host, self._events))
        self._host, self._events = 0.0, []

    def gather(self) -> torch.Tensor:
        """On the device, [world, 1 + steps]: each rank's pipeline stage, then its seconds of each
        step kept (collective: every rank gathers at the same steps, so all keep as many)."""
        if self.gpu and self.steps and self.steps[-1][1]:
            self.steps[-1][1][-1][1].synchronize()
        mine = [h + sum(a.elapsed_time(b) for a, b in events) / 1e3 for h, events in self.steps]
        self.steps = []
        table = torch.zeros(dist.get_world_size(), 1 + len(mine), dtype=torch.float64, device=self.device)
        table[dist.get_rank()] = torch.tensor([self.stage, *mine], dtype=torch.float64)
        dist.all_reduce(table)
        return table


def stragglers(table: list[list[float]]) -> list[tuple[int, float, float]]:
    """The slow ranks of a gather (read back: a row per rank, its stage and its seconds a step):
    (rank, its median seconds a step, its peers' median)."""
    stages, medians = [row[0] for row in table], [statistics.median(row[1:]) for row in table]
    slow = []
    for rank, mine in enumerate(medians):
        others = [r for r in range(len(medians)) if r != rank]
        peers = [r for r in others if stages[r] == stages[rank]] or others
        if not peers:
            continue
        median = statistics.median(medians[r] for r in peers)
        if mine > FACTOR * median and mine - median > MIN_EXCESS_S:
            slow.append((rank, mine, median))
    return slow


def straggler_line(step: int, rank: int, mean: float, median: float) -> str:
    return (
        f"mega-train: step {step}: rank {rank} is slow: its own work (batch and update) took "
        f"{mean:.3f} s a step, {mean / max(median, 1e-9):.1f}x its peers' median ({median:.3f} s)"
    )
