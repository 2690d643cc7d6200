"""The learning-rate schedule and fp16's dynamic loss scale: the arithmetic of a step, no torch.

**Learning rate.** Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine or linear
decay to `min_lr` at `train_steps` (or constant). Step indices count from 0: step k is the (k+1)-th
update.

**Changing `train_steps` on resume** stretches (or shrinks) what is left of the decay over the new
remaining steps, so the learning rate continues without a jump: a run resumed at step s whose
decay had reached progress p(s) under the old length continues with

    p(k) = p(s) + (1 - p(s)) * (k - s) / (train_steps - s)        for k >= s,

which equals the old p(s) at k = s and reaches 1 (min_lr) at the new `train_steps`. The point
(s, p(s)) is the schedule's *anchor*, saved in every checkpoint (`training.scheduler`), so a second
change composes with the first. A change during warmup anchors at the end of warmup (p = 0 there),
which is the plain schedule of the new length.

**Loss scale (fp16).** A step whose gradients overflow (finite loss, non-finite norm) halves the
scale (not below 1) and is skipped; `loss_scale_window` applied steps in a row double it. Any other
non-finite step is a NaN step, which `nan.policy` judges. A skipped step still counts and consumes
its batch (Megatron's convention, and what keeps resumes exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megacore.artifacts.run_spec import OptimizerSpec


@dataclass(frozen=True)
class Schedule:
    """The learning rate of every step of a run of `total` steps; `anchor` (step, progress) when
    `total` changed on resume (module docstring)."""

    opt: OptimizerSpec
    total: int
    anchor: tuple[int, float] | None = None

    def progress(self, step: int) -> float:
        """How far the decay is at `step`, from 0 (end of warmup) to 1 (min_lr)."""
        w = self.opt.warmup_steps
        if self.anchor is None or self.anchor[0] < w:
            return min(1.0, max(0, step - w) / max(1, self.total - w))
        s, p = self.anchor
        return min(1.0, p + (1 - p) * max(0, step - s) / max(1, self.total - s))

    def lr(self, step: int) -> float:
        opt = self.opt
        if step < opt.warmup_steps:
            return opt.lr * (step + 1) / opt.warmup_steps
        if opt.schedule == "constant":
            return opt.lr
        progress = self.progress(step)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if opt.schedule == "cosine" else 1 - progress
        return opt.min_lr + (opt.lr - opt.min_lr) * decay

    def resized(self, total: int, step: int) -> Schedule:
        """This schedule continued from `step` (steps done) over a run of `total` steps."""
        if total == self.total:
            return self
        at = max(step, self.opt.warmup_steps)
        return Schedule(self.opt, total, (at, self.progress(at)))

    def saved(self, step: int) -> dict[str, float | int | str]:
        """What a checkpoint records (`training.scheduler`): the last step's lr, the run length and
        the anchor, from which `restored` rebuilds this schedule."""
        out: dict[str, float | int | str] = {
            "name": self.opt.schedule,
            "lr": self.lr(max(step - 1, 0)),
            "train_steps": self.total,
        }
        if self.anchor is not None:
            out["anchor_step"], out["anchor_progress"] = self.anchor
        return out

    @staticmethod
    def restored(opt: OptimizerSpec, saved: dict, default_total: int) -> Schedule:
        """The schedule a checkpoint was saved under (`default_total` for checkpoints that did not
        record their length: those of an earlier version, whose length could not change)."""
        total = int(saved.get("train_steps", default_total))
        anchor = None
        if "anchor_step" in saved:
            anchor = (int(saved["anchor_step"]), float(saved["anchor_progress"]))
        return Schedule(opt, total, anchor)


@dataclass
class LossScale:
    """Skip rules and fp16's dynamic loss scale (module docstring); `scale` is None without fp16."""

    scale: float | None
    window: int
    counters: dict[str, int] = field(default_factory=lambda: {"skipped": 0, "nan_steps": 0, "scale_good": 0})

    @property
    def factor(self) -> float:
        """What the loss is multiplied by before backward (1 without fp16)."""
        return self.scale or 1.0

    def judge(self, loss_finite: bool, norm_finite: bool) -> bool:
        """Count a finished step; returns whether its update was applied (loss and norm finite:
        the optimizer skips it on the device, `Trainer.step`)."""
        applied = loss_finite and norm_finite
        c = self.counters
        if not applied:
            c["skipped"] += 1
        if self.scale is not None:
            if not applied and loss_finite:  # an fp16 overflow, not a NaN step
                self.scale = max(self.scale / 2, 1.0)
                c["scale_good"] = 0
                return applied
            c["scale_good"] = c["scale_good"] + 1 if applied else 0
            if c["scale_good"] >= self.window:
                self.scale *= 2
                c["scale_good"] = 0
        if not applied:
            c["nan_steps"] += 1
        return applied
