"""A batch of completions scored by a run's reward functions (`mega_train.rewards`): each called
once on the whole batch with TRL's arguments, its scores checked (a number or None per row), and
the rows' total, TRL's: the weighted sum of each row's scores that are not None."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mega_train.rewards.load import Reward


class RewardError(Exception):
    """A reward function raised or returned what is not a score: its one line (the run saves, then
    stops with it)."""


@dataclass(frozen=True)
class Scores:
    total: list[float]  # per row: the weighted sum of its scores that are not None
    by_name: dict[str, list[float | None]]  # per function, per row


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
) -> Scores:
    """Every reward of every row (module docstring); RewardError naming the function and the row."""
    rows = len(completions)
    total, by_name = [0.0] * rows, {}
    for reward in rewards:
        values = _call(reward, prompts, completions, completion_ids, columns)
        by_name[reward.name] = values
        for i, v in enumerate(values):
            if v is not None:
                total[i] += reward.weight * v
    return Scores(total, by_name)


def _call(
    reward: Reward,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
) -> list[float | None]:
    args = (list(prompts), list(completions), [list(ids) for ids in completion_ids])
    try:
        values = reward.fn(prompts=args[0], completions=args[1], completion_ids=args[2], **columns)
    except Exception as e:  # the user's code: whatever it raises
        row = _first_failing_row(reward, args, columns)
        raise RewardError(f"reward {reward.name} raised {type(e).__name__}: {e}{row}") from None
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
        raise RewardError(f"reward {reward.name} returned {got} for {len(completions)} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)):
            raise RewardError(f"reward {reward.name} gave row {i} {v!r}, not a finite number or None")
        out.append(None if v is None else float(v))
    return out


def _first_failing_row(
    reward: Reward, args: tuple[list, list, list], columns: Mapping[str, Sequence[Any]]
) -> str:
    """ " on row i (prompt ...)" for the first row that raises alone ("" when none does)."""
    for i in range(len(args[1])):
        one = {name: [values[i]] for name, values in columns.items()}
        try:
            reward.fn(prompts=[args[0][i]], completions=[args[1][i]], completion_ids=[args[2][i]], **one)
        except Exception:
            return f" on row {i} (prompt {str(args[0][i])[:60]!r})"
    return ""
