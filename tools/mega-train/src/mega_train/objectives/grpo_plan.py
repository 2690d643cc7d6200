"""An online RL run's settings checked without torch (`objective` grpo), and the settings every
objective shares checked against its type (`beta`, `loss`).

GRPO samples its completions with the sampler (`megacore.parallel.sampler`), which runs under tp,
pp, dp and ep: cp, sequence parallel and fp8 are refused, and its blocks run eager
(`compile` true is refused; "auto" never compiles). A row holds a prompt and one completion, so
`seq_length` leaves room for `max_completion_length` tokens after a prompt. Its reward functions are
imported here, so a wrong name or file fails the dry run. With `beta` > 0 the KL penalty's
reference is the model the run starts from: the base with its adapters off under LoRA, else a
frozen copy of `model.init`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from mega_train.rewards import Reward, load_rewards
from megacore.artifacts import RunManifest
from megacore.errors import UserError

GRPO_LOSSES = ("grpo", "dapo", "bnpo", "dr_grpo")
PAIR_LOSSES = ("sigmoid", "ipo")


def check_objective(run: RunManifest, has_init: bool, lora: bool, base: Path, where: str) -> list[Reward]:
    """The objective's own settings against its type; grpo's reward functions, loaded."""
    spec = run.objective
    grpo = spec.type == "grpo"
    losses = GRPO_LOSSES if grpo else PAIR_LOSSES
    if spec.loss not in losses and (grpo or spec.type == "dpo"):
        raise UserError(f"$.objective.loss: {spec.type} takes {' or '.join(losses)}, not {spec.loss}", where)
    if spec.type in ("dpo", "simpo", "orpo") and spec.beta <= 0:
        raise UserError(f"$.objective.beta: {spec.type} needs beta > 0, got {spec.beta:g}", where)
    if not grpo:
        return []
    _check_grpo(run, has_init, lora, where)
    if not spec.rewards:
        raise UserError(
            "$.objective.rewards: grpo scores its completions with at least one reward function", where
        )
    specs = [msgspec.structs.asdict(r) for r in spec.rewards]
    try:
        return load_rewards(specs, base, "$.objective.rewards")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _check_grpo(run: RunManifest, has_init: bool, lora: bool, where: str) -> None:
    """What the sampler and the rows need of the layout and the batch."""
    spec, par = run.objective, run.parallel
    unsupported = (
        ("$.parallel.cp", par.cp > 1),
        ("$.parallel.sequence_parallel", par.sequence_parallel), ("$.precision fp8", run.precision == "fp8"),
        ("$.compile true", run.compile is True),
    )  # fmt: skip
    for name, on in unsupported:
        if on:
            raise UserError(
                f"{name}: grpo samples its completions with the sampler, which does not run under it yet",
                where,
            )
    if run.batch.seq_length <= spec.max_completion_length:
        raise UserError(
            f"$.batch.seq_length: a row holds a prompt and its completion; {run.batch.seq_length} leaves "
            f"no room for a prompt before $.objective.max_completion_length {spec.max_completion_length}",
            where,
        )
    if spec.beta > 0 and not has_init and not lora:
        raise UserError(
            "$.objective.beta: the KL penalty's reference is the model the run starts from; set "
            "$.model.init (or 0, no penalty)",
            where,
        )


def describe(run: RunManifest, rewards: list[Reward]) -> str:
    """The dry run's and the run's note on the rollouts."""
    spec = run.objective
    names = ", ".join(f"{r.name} x {r.weight:g}" for r in rewards)
    reference = f", beta {spec.beta:g}" if spec.beta else ""
    return (
        f"grpo: {spec.num_generations} completions a prompt, up to {spec.max_completion_length} tokens at "
        f"temperature {spec.temperature:g}; loss {spec.loss}{reference}; rewards {names}"
    )
