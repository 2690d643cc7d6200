"""A train step's record in metrics.jsonl, made in two halves so that a step reads nothing back
from the device but its stop request and finiteness: the host values at the step (`train_record`:
the learning rate, speed, loss scale and counters, memory), and the device values (loss, gradient
norm, counted targets where some may not count, router and objective statistics) kept on the
device (`Pending`) until `Trainer.flush` reads every pending step's back at once (`read_back`),
with every rank's own work per step (`stragglers.OwnWork`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mega_train.metrics import memory_gb
from mega_train.schedule import LossScale


@dataclass
class Pending:
    """A step's record whose device values (`device`: loss, grad_norm, counted targets, router
    statistics) are read back at the next `Trainer.flush`."""

    record: dict
    device: dict[str, torch.Tensor]


def train_record(
    step: int,
    lr: float,
    count: torch.Tensor | int,
    dt: float,
    compiled: float,
    *,
    tokens: int,
    flops: float,
    peak: float | None,
    scaler: LossScale,
    world_size: int,
) -> dict:
    """Step `step`'s record with its host values; `read_back` adds the device ones. `tokens`: the
    global batch's; `flops`: a token's; `peak`: the device's peak FLOP/s in TFLOP/s (None: no MFU)."""
    # A compiling step's speed is that of its steps' work: the compile is reported apart.
    tps = tokens / max(dt - compiled, 1e-9)
    c = scaler.counters
    return {
        "step": step, "kind": "train", "loss": None, "lr": lr, "grad_norm": None,
        "tokens_per_s": tps, "counted_tokens": count if isinstance(count, int) else None,
        "tflops": tps * flops / 1e12, "mfu": tps * flops / 1e12 / peak if peak else None,
        "skipped": c["skipped"], "nan_steps": c["nan_steps"], "loss_scale": scaler.scale,
        "memory_gb": memory_gb(), "step_time_s": dt, "compile_s": compiled,
        "world_size": world_size,
    }  # fmt: skip


def read_back(pending: list[Pending], ranks: torch.Tensor) -> list[list[float]]:
    """Rank 0: the pending steps' device values and `ranks` (every rank's own work per step, a row
    a rank: `OwnWork.gather`) read back in one, the values into their steps' records; returns the
    work as read: a row a rank, its pipeline stage, then its seconds of each step."""
    device = torch.stack([v.double() for p in pending for v in p.device.values()])
    read = torch.cat([device, ranks.flatten()]).tolist()  # the flush's one read
    values, n = iter(read[: device.numel()]), ranks.shape[1]
    table = [read[device.numel() + r * n : device.numel() + (r + 1) * n] for r in range(ranks.shape[0])]
    for i, p in enumerate(pending):
        p.record.update((k, next(values)) for k in p.device)
        p.record["rank_local_s"] = [row[1 + i] for row in table]
        if "counted_tokens" in p.device:
            p.record["counted_tokens"] = int(p.record["counted_tokens"])
    return table
