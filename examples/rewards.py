"""A reward function for examples/grpo.json (`"rewards.py:digits_only"`, relative to the manifest),
called as TRL calls its reward functions: the batch's prompts, completions (text; messages for chat
prompts), their token ids and the prompts' other columns by name; a score, or None where it does
not apply, per completion."""


def digits_only(completions: list[str], **_: object) -> list[float | None]:
    """1 for an answer that is a number alone, else 0: the format the `exact` reward then scores."""
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
