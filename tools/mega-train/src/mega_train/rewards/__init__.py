"""Reward functions for online RL (the `grpo` objective, `mega_train.objectives.grpo`): a program
scores each completion the model writes, and the model learns from its own scored samples.

A run's `rewards` list names each function and its weight, as `{"function": F, "weight": w, "args":
{...}}`: F a built-in name (`builtin.BUILTINS`: `math`, `exact`, `format`, `length`), a
`"path/to/file.py:name"` relative to the run manifest's directory, or a `"package.module:name"`;
`args` are keyword arguments bound to it (a built-in's settings: `format`'s `pattern`, `length`'s
`max_length` and `cache`). Every function is called as TRL's `GRPOTrainer` calls its reward
functions, `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`: the rows'
prompts and completions as text (for chat prompts TRL's conversational form, a list of one
assistant message each), the completions' token ids, and every other column of the prompts' data
by name (`answer`, `solution`, ...); None marks a row the function does not apply to. Scoring runs
on the host of the rank that calls it (`score.score`); a function that raises or returns what is not
a score is one line naming it and the first row that fails (`RewardError`).
"""

from mega_train.rewards.load import Reward, load_rewards
from mega_train.rewards.score import RewardError, Scores, score

__all__ = ["Reward", "RewardError", "Scores", "load_rewards", "score"]
