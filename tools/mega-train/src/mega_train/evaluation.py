"""Evaluation metrics: next-token accuracy and the user's `eval.metrics`, summed over the eval
batches and the dp ranks.

A metric is `fn(logits, targets, mask) -> {name: (total, count)}`: `logits` [b, s, vocab_size] over
the whole vocab, `targets` [b, s] token ids, `mask` [b, s] bool, True where the loss counts (targets
not IGNORE). It is called on each eval microbatch,
once per dp rank (`ParallelModel.evaluate`); a name's value is the sum of its totals over the sum
of its counts. The loss enters the same sums as (a dp rank's batch mean times its counted
targets, their count), so one collective combines everything.

Importing the metrics (`load_metric`) needs no torch: the plan checks them before any process group.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from megacore.data.packing import IGNORE
from megacore.errors import UserError

if TYPE_CHECKING:
    import torch

    Metric = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, tuple[float, float]]]

# Fields of the eval record that a user metric cannot take.
RESERVED = (
    "step",
    "kind",
    "loss",
    "ppl",
    "accuracy",
    "assistant_loss",
    "assistant_ppl",
    "assistant_accuracy",
)


def load_metric(path: str, at: str, where: str) -> Metric:
    """`package.module:function` -> the function; a UserError at `at` (a manifest field) if the module
    does not import or the attribute is missing or not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{at}: {path!r} is not an import path `module:function`", where)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        why = f"{type(e).__name__}: {e}".replace("\n", " ")
        raise UserError(f"{at}: cannot import module {module_name!r} ({why})", where) from None
    fn: object = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise UserError(f"{at}: module {module_name!r} has no attribute {attr!r}", where)
        fn = getattr(fn, part)
    if not callable(fn):
        raise UserError(f"{at}: {path!r} is not callable (a {type(fn).__name__})", where)
    return fn  # type: ignore[return-value]


def accuracy(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> dict[str, tuple[float, float]]:
    """Next-token accuracy: the top logit is the target."""
    hits = (logits.argmax(-1) == targets) & mask
    return {"accuracy": (float(hits.sum()), float(mask.sum()))}


class EvalSums:
    """One evaluation's sums on this rank: `add_loss` and `add_logits` as the batches go by, then
    `combine` (a collective: every rank calls it)."""

    def __init__(self, paths: list[str], metrics: list[Metric], where: str) -> None:
        user = [
            (f"$.eval.metrics[{i}] ({p})", fn) for i, (p, fn) in enumerate(zip(paths, metrics, strict=True))
        ]
        self.metrics = [("accuracy", accuracy), *user]
        self.where = where
        self.sums: dict[str, list[float]] = {}

    def add_loss(self, loss: float, counted: int) -> None:
        """A dp rank's mean loss over its `counted` targets of one batch."""
        self._add("loss", loss * counted, float(counted))

    def add_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        mask = targets != IGNORE
        owner: dict[str, str] = {}
        for at, fn in self.metrics:
            result = fn(logits, targets, mask)
            if not isinstance(result, dict):
                raise UserError(
                    f"{at} returned a {type(result).__name__}, not {{name: (total, count)}}", self.where
                )
            for name, value in result.items():
                if not isinstance(name, str) or name in owner or (fn is not accuracy and name in RESERVED):
                    taken = f"already {owner[name]}'s" if name in owner else "not available"
                    raise UserError(f"{at} returned the metric name {name!r}, {taken}", self.where)
                if not (isinstance(value, tuple | list) and len(value) == 2):
                    raise UserError(
                        f"{at} returned {name!r}: {value!r}, not a pair (total, count)", self.where
                    )
                owner[name] = at
                self._add(name, float(value[0]), float(value[1]))

    def add_assistant(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Loss and accuracy over the assistant's tokens alone (`targets` IGNORE elsewhere), for chat
        data trained on every token."""
        import torch.nn.functional as F

        mask = targets != IGNORE
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE
        )
        count = float(mask.sum())
        self._add("assistant_loss", float(loss), count)
        self._add("assistant_accuracy", *accuracy(logits, targets, mask)["accuracy"])

    def _add(self, name: str, total: float, count: float) -> None:
        sums = self.sums.setdefault(name, [0.0, 0.0])
        sums[0] += total
        sums[1] += count

    def combine(self) -> dict[str, float]:
        """Every rank's sums added up (one all-gather of these small dicts: ranks without the last
        stage have none, and only the ranks that call the metrics know their names); each name's
        total over its count, NaN for a count of 0."""
        import torch.distributed as dist

        gathered: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.sums)
        total: dict[str, list[float]] = {}
        for sums in gathered:
            for name, (t, c) in (sums or {}).items():
                acc = total.setdefault(name, [0.0, 0.0])
                acc[0] += t
                acc[1] += c
        return {name: t / c if c else math.nan for name, (t, c) in total.items()}
