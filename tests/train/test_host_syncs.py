"""A training step reads the device back to the host at most once (issue: no per-step stalls).

On a GPU every `.item()`, `float(t)`, `bool(t)`, `torch.equal`, `.tolist()` or `.cpu()` of a device
tensor waits for the device to finish all it was given; a CPU never waits, so the reads are counted
instead, over a real run of mega-train's `Trainer.fit` (one process, 4 microbatches a step, a line
logged every 10 steps): the dispatcher's host reads (`aten._local_scalar_dense`, `aten.equal`,
`aten.is_nonzero`) through a `TorchDispatchMode`, and the reads the dispatcher does not see on a CPU
(`Tensor.tolist`, `.cpu`, `.numpy`) through torch's own methods, wrapped to count. Each read is
charged to the trainer's method it happens in, found on the Python stack. A step may read once (the
stop request and whether its loss and norm were finite); the values a record reports are read at
the logging steps, once per flush.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runlib import write_run

SYNC_OPS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}
UNSEEN = ("tolist", "cpu", "numpy")  # host reads the dispatcher does not see on a CPU tensor
STEPS, EVERY, MICROBATCHES = 20, 10, 4


class HostReads(TorchDispatchMode):
    """Counts host reads by the trainer method on the stack when they happen (`charged`)."""

    def __init__(self, charged: dict) -> None:
        super().__init__()
        self.charged = charged  # code object -> name
        self.reads: Counter = Counter()

    def note(self) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self.charged:
                self.reads[self.charged[frame.f_code]] += 1
                return
            frame = frame.f_back
        self.reads["elsewhere"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNC_OPS:
            self.note()
        return func(*args, **(kwargs or {}))


def _fit(plan, monkeypatch) -> Counter:
    """`Trainer.fit` of `plan` with its host reads counted by the trainer method they happen in."""
    from mega_train.trainer import Trainer
    from megacore.parallel.mesh import shutdown

    trainer = Trainer(plan)
    charged = {Trainer.step.__code__: "step", Trainer.flush.__code__: "flush"}
    try:
        trainer.setup()
        trainer.resume()
        mode = HostReads(charged)
        for name in UNSEEN:
            method = getattr(torch.Tensor, name)

            def counted(self, *args, _method=method, **kwargs):
                mode.note()
                return _method(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        with mode:
            summary = trainer.fit()
    finally:
        monkeypatch.undo()
        trainer.close(ok=True)
        shutdown()
    assert summary["step"] == STEPS and summary["complete"], summary
    return mode.reads


@pytest.mark.parametrize("data", ["text", "documents"])
def test_a_step_reads_the_device_once(tmp_path: Path, tokens: Path, data: str, monkeypatch) -> None:
    """20 steps of 4 microbatches, logged every 10: at most one read a step (the stop flag and the
    finiteness, in one), one per flush; `documents`: packed documents kept apart (doc_mask), whose
    targets may not count, so the counts are device tensors too."""
    from mega_train.run_plan import plan_run
    from runlib import metrics

    run_json = write_run(
        tmp_path, tokens, train_steps=STEPS, precision="bf16",
        batch={"micro_batch_size": 1, "global_batch_size": MICROBATCHES, "seq_length": 32},
        data={"doc_mask": data == "documents"}, checkpoint={"every": STEPS}, eval={"every": 0},
        logging={"every": EVERY},
    )  # fmt: skip
    reads = _fit(plan_run(run_json, 1), monkeypatch)
    assert reads["step"] <= STEPS, f"{reads['step']} host reads in {STEPS} steps: {dict(reads)}"
    # Flushed at the logging steps (the last one also the checkpoint's): one read each.
    assert reads["flush"] <= STEPS // EVERY, f"{reads['flush']} host reads in flushes: {dict(reads)}"
    # The records are all there, each with the values read at its flush.
    records = metrics(run_json.parent / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records)
    assert all(r["counted_tokens"] > 0 for r in records)
