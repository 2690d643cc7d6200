"""What a run minimises: an objective, chosen by `$.objective.type` from `REGISTRY`.

An objective has two halves. Its plan half is torch-free, so a dry run checks it without torch:
what its data must hold (`check_data`), what a batch counts (`Kind.counts`: the batch sizes'
samples, which a checkpoint's `consumed_samples` counts too) and the models it reads besides the
run's own (`reference_plan.py`: DPO's reference; `teacher_plan.py`: distillation's teacher). Its run
half (`Kind.runtime`, a class deriving from `base.Objective`, as `module:Class`) is imported only by
the trainer (`load`), which calls its hooks and names no objective: how a step's rows become
tensors and what they count, the loss handed to the engine, the metrics of a step and the
evaluation.

- `lm` (`lm.py`): language modelling, the default: next-token cross entropy over the counted
  targets.
- `dpo`, `simpo`, `orpo` (`preference.py`): over pairs of sequences (`megacore.models.preference`).
- `distill` (`distill.py`): language modelling with a frozen teacher's token distributions
  (`megacore.parallel.divergence`).
- `grpo` (`grpo.py`): online RL on prompts, the model's own completions scored by reward functions
  (`megacore.models.grpo`; its plan half, `grpo_plan.py`).

A new objective is a module with its class, and one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megacore.artifacts import RunManifest, TokensManifest
from megacore.errors import UserError

if TYPE_CHECKING:
    from mega_train.objectives.base import Objective


@dataclass(frozen=True)
class Kind:
    """An objective's plan half: `runtime` its run half (`module:Class`), `counts` what the batch sizes
    count (one sequence a sample, a pair of two, a prompt), `pairs` whether it trains on preference
    pairs (tokens of `mega-tokenize --format preference`), `prompts` whether on prompts (`--format
    prompts`), whose completions it samples."""

    runtime: str
    counts: str = "sequences"
    pairs: bool = False
    prompts: bool = False


PREFERENCE = Kind("mega_train.objectives.preference:PreferenceObjective", counts="pairs", pairs=True)
REGISTRY: dict[str, Kind] = {
    "lm": Kind("mega_train.objectives.lm:LanguageModelling"),
    "dpo": PREFERENCE,
    "simpo": PREFERENCE,
    "orpo": PREFERENCE,
    "distill": Kind("mega_train.objectives.distill:Distill"),
    "grpo": Kind("mega_train.objectives.grpo:GRPOObjective", counts="prompts", prompts=True),
}
PAIR_TYPES = tuple(name for name, kind in REGISTRY.items() if kind.pairs)


def kind_of(run: RunManifest) -> Kind:
    return REGISTRY[run.objective.type]


def check_data(at: str, path: Path, tokens: TokensManifest, run: RunManifest, where: str) -> None:
    """A data source holds what the objective trains on: pairs for a pair objective, and only for
    one."""
    kind, name = kind_of(run), run.objective.type
    if kind.prompts and tokens.format != "prompts":
        raise UserError(
            f"{at}: $.objective.type {name} samples completions of prompts, and {path} holds "
            f"{tokens.format} tokens (mega-tokenize --format prompts)",
            where,
        )
    if tokens.format == "prompts" and not kind.prompts:  # completions the model writes: online RL's
        raise UserError(
            f"{at}: {path} holds prompts (mega-tokenize --format prompts), which $.objective.type {name} "
            "does not train on; train on them with $.objective.type grpo",
            where,
        )
    if not kind.pairs and tokens.format == "preference":
        raise UserError(
            f"{at}: {path} holds preference pairs; train on them with $.objective.type "
            f"{', '.join(PAIR_TYPES[:-1])} or {PAIR_TYPES[-1]}",
            where,
        )
    if kind.pairs and (tokens.format != "preference" or "completion" not in tokens.roles):
        raise UserError(
            f"{at}: $.objective.type {name} trains on pairs, and {path} holds {tokens.format} tokens "
            "(mega-tokenize --format preference)",
            where,
        )
    if (kind.pairs or kind.prompts) and run.data.loss_on != "all":
        raise UserError(
            f"$.data.loss_on: {run.data.loss_on} does not apply to $.objective.type {name}, which counts "
            f"each {'pair' if kind.pairs else 'prompt'}'s completions",
            where,
        )


def load(trainer: object) -> Objective:
    """The run half of the trainer's objective (imports torch)."""
    module, name = kind_of(trainer.plan.run).runtime.split(":")
    return getattr(importlib.import_module(module), name)(trainer)
