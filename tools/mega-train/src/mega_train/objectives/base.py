"""The hooks a trainer calls on its objective (`mega_train.objectives`), with a token objective's
defaults.

The trainer (`trainer.Trainer`) owns the run: the mesh, the data, the model, the optimizer, the
step's reduction, clipping and update, saving. It hands itself to its objective (`self.t`), and
calls, in a run's order:

- `roles(valid)` once the samples are indexed: which role's tokens are the targets, and which
  role evaluation also reports apart; `open_data()` then: the warnings of data the objective
  leaves out;
- `setup()` once the model is built: what the objective holds beside it (a teacher);
- `start()` before the run resumes or starts: what it computes once (a reference's
  log-probabilities);
- per step `step_rows(step)`: the rows' tensors and what they count on this rank (by default
  `batch(rows, role)` of the step's global batch, as per evaluation batch), `global_count(counted)`: what the step's mean divides by, `loss(which, k)`: the
  engine's loss for batch k of `train` or `valid` (`megacore.parallel.losses.Loss`; None: language
  modelling's), `metrics()`: the step's device metrics, added to its record;
- `evaluate()` and `eval_record(values)`: an evaluation over the valid batches, and its record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mega_train.train_data import loss_roles
from megacore.data.dataset import Batch, Dataset
from megacore.parallel.losses import Loss

if TYPE_CHECKING:
    from mega_train.trainer import Trainer


class Objective:
    """An objective's run half; these defaults are a token objective's."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def roles(self, valid: Dataset | None) -> tuple[int | None, int | None]:
        """The role code whose targets alone count (None: every target), and the one evaluation
        also reports apart (`train_data.loss_roles`: `loss_on` and chat data)."""
        return loss_roles(self.t.plan, valid)

    def open_data(self) -> None:
        """Once the train and valid samples are indexed."""

    def setup(self) -> None:
        """Once the model is built."""

    def start(self) -> None:
        """Before the run resumes or starts."""

    def consumed(self, steps: int) -> int:
        """The samples `steps` train steps have read (a checkpoint's `consumed_samples`)."""
        return steps * self.t.samples

    def step_rows(self, step: int) -> tuple:
        """The rows train step `step` (from 0) trains on: its global batch's on this rank."""
        return self.batch(self.t.rows(self.t.train_data, step), self.t.train_role)

    def batch(self, b: Batch, role: int | None) -> tuple:
        """Rows of a batch as the engine takes them (`Trainer.batch`)."""
        return self.t.batch(b, role)

    def global_count(self, counted: torch.Tensor | int) -> torch.Tensor | int:
        """What the step's mean divides by: the global batch's counted targets."""
        return self.t.global_count(counted)

    def loss(self, which: str, k: int) -> Loss | None:
        """The engine's loss for batch `k` of `which` (train, valid); None: language modelling's."""
        return None

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's metrics of the objective's own, device tensors (read at `flush`)."""
        return {}

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def eval_record(self, ev: dict[str, float]) -> dict:
        raise NotImplementedError
