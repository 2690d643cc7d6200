"""Knowledge distillation (`objective` distill): language modelling with a frozen teacher's token
distributions.

Per counted target token the loss is a × CE + (1 − a) × T² × D(teacher_T, student_T), averaged over
the global batch's counted targets as language modelling's loss is (`alpha` a, `temperature` T, the
`divergence` D: `megacore.parallel.divergence`; T² keeps the soft targets' gradients the size of
the hard ones', Hinton et al. 2015). The teacher (`teacher_plan.py`) is a second `ParallelModel`
in the run's layout, frozen and never saved, whose forward runs beside each microbatch on the same
tokens: under tp its logits are vocab-parallel like the student's, under cp each rank's part of the
rows. LoRA trains adapters on the student only. The evaluation is language modelling's (held-out
cross entropy, accuracy); every step also reports `distill/ce` and `distill/kl` (the divergence,
whichever it is), means over the counted targets.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mega_train.objectives.lm import LanguageModelling
from megacore.config import CONTEXT_FIELDS, TOKEN_ID_FIELDS
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.divergence import token_divergence
from megacore.parallel.engine import ParallelModel
from megacore.parallel.losses import Loss, Microbatch


class DistillLoss(Loss):
    """a × CE + (1 − a) × T² × D, summed over a microbatch's counted targets, from the student's
    logits and the teacher's of the same tokens; each microbatch's (CE, D) sums kept in `sums`."""

    fused = None  # the divergence needs the student's logits

    def __init__(self, student: ParallelModel, teacher: ParallelModel, spec, sums: dict) -> None:
        super().__init__(student.config.vocab_size, student.tp_mesh)
        self.teacher, self.spec, self.sums = teacher, spec, sums

    def of_logits(self, mb: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        theirs = self.teacher.microbatch_logits(mb)  # without autograd
        ce = super().of_logits(mb, logits)
        d = token_divergence(
            logits, theirs, mb.targets, spec.divergence, spec.temperature, self.vocab_size, self.tp_mesh
        )
        self.sums[mb.index] = torch.stack([ce.detach(), d.detach()]).double()
        return spec.alpha * ce + (1 - spec.alpha) * spec.temperature**2 * d


class Distill(LanguageModelling):
    """The distill objective's run half (module docstring)."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self._sums: dict[int, torch.Tensor] = {}
        self._count: torch.Tensor | int = 1

    def setup(self) -> None:
        """The teacher in the student's layout: built, frozen, loaded."""
        t = self.t
        teacher = t.plan.teacher
        par = dataclasses.replace(t.pm.par, lora=None, compile=False)
        self.teacher = ParallelModel(teacher.manifest.config, par, t.mesh, t.device)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        load_checkpoint(teacher.path, self.teacher, ignore=(*TOKEN_ID_FIELDS, *CONTEXT_FIELDS))
        self.teacher.refresh()  # its compute copies, once: it never changes

    def global_count(self, counted: torch.Tensor | int) -> torch.Tensor | int:
        self._count = super().global_count(counted)
        return self._count

    def loss(self, which: str, k: int) -> Loss | None:
        """The distillation loss in training; the evaluation is language modelling's."""
        if which != "train":
            return None
        self._sums = {}
        return DistillLoss(self.t.pm, self.teacher, self.t.run.objective, self._sums)

    def metrics(self) -> dict[str, torch.Tensor]:
        """The step's mean cross entropy and divergence over the global batch's counted targets:
        each rank's sums added over the ranks holding other rows or parts of them (dp, cp)."""
        t = self.t
        total = torch.zeros(2, dtype=torch.float64, device=t.device)
        if self._sums:
            total += torch.stack(list(self._sums.values())).sum(0)
        dist.all_reduce(total, group=t.pm.data_mesh.get_group())
        mean = total / self._count
        return {"distill/ce": mean[0], "distill/kl": mean[1]}
