"""Preference pairs (DPO data) to token segments, for `--format preference`.

Rows in TRL's two preference dataset formats:
- standard: `{"prompt": str, "chosen": str, "rejected": str}`. As TRL's DPOTrainer does, the prompt
  and each completion are encoded apart and concatenated: BOS (`--prepend-bos`) before the prompt,
  EOS (`--append-eos`) after each completion, as part of it.
- conversational: `prompt`, `chosen` and `rejected` arrays of `{"role", "content"}` messages; each
  side is rendered as one conversation, prompt + completion, by the chat renderer of
  `--chat-template` (`with_ends` included, as for `--format chat`). Without `prompt`, `chosen` and
  `rejected` are whole conversations and their shared leading messages are the prompt (TRL's
  implicit prompt).

Every pair is two documents, chosen then rejected. The prompt's tokens keep their chat role codes (a
standard prompt is the user's; BOS and template text 0); every token of the completion (its
contents, the end marker of each of its messages, the standard format's EOS) is COMPLETION, so the
trainer finds what the preference objective compares without knowing the template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mega_tokenize.chat import ROLE_CODES, ChatError, Segment, json_type, message_list
from megacore.errors import UserError

COMPLETION = 5
# The manifest's `roles` for preference artifacts: chat's codes and the completion's.
PREFERENCE_ROLES: dict[str, int] = {**ROLE_CODES, "completion": COMPLETION}
SIDES = ("chosen", "rejected")

Messages = list[tuple[str, str]]


@dataclass
class Pair:
    """One row: the prompt and the two completions, all strings (standard) or all messages."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages


def _kind(row: dict, key: str) -> str:
    """The format a value belongs to, "a string" (standard) or "an array" (messages); a ChatError
    for anything else."""
    kind = json_type(row[key])
    if kind not in ("a string", "an array"):
        raise ChatError(f'"{key}" is {kind}, expected a string or an array of messages')
    return kind


def pair_of(row: object) -> Pair:
    """The pair of one jsonl record or Parquet row ({column: value}), validated; a ChatError says
    what is wrong (the caller adds where)."""
    if not isinstance(row, dict):
        raise ChatError("expected a JSON object with chosen and rejected")
    for key in SIDES:
        if key not in row:
            raise ChatError(f'missing key "{key}"')
    keys = ["prompt", *SIDES] if "prompt" in row else list(SIDES)
    kinds = {k: _kind(row, k) for k in keys}
    if len(set(kinds.values())) > 1:
        said = ", ".join(f'"{k}" is {v}' for k, v in kinds.items())
        raise ChatError(f"mixed formats: {said} (all strings, or all arrays of messages)")
    if kinds["chosen"] == "a string":
        if "prompt" not in row:
            raise ChatError('missing key "prompt" (only conversations may leave it out)')
        pair = Pair(row["prompt"], row["chosen"], row["rejected"])
        if not pair.prompt or pair.prompt.isspace():
            raise ChatError('"prompt" is empty')
        for key in SIDES:
            if not row[key] or row[key].isspace():
                raise ChatError(f'"{key}": empty completion')
    else:
        pair = _conversations(row)
    if pair.chosen == pair.rejected:
        raise ChatError('"chosen" and "rejected" are the same completion')
    return pair


def _conversations(row: dict) -> Pair:
    """A conversational row as prompt and completions: its `prompt`, or the leading messages chosen
    and rejected share."""
    sides = {}
    for key in SIDES:
        if not row[key]:
            raise ChatError(f'"{key}": empty completion (no messages)')
        sides[key] = message_list(row[key], key)
    chosen, rejected = sides["chosen"], sides["rejected"]
    if "prompt" in row:
        prompt = message_list(row["prompt"], "prompt")
    else:
        if chosen == rejected:
            raise ChatError('"chosen" and "rejected" are the same conversation')
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise ChatError(
                'the prompt does not match: "chosen" and "rejected" share no leading messages '
                '(start both with the same prompt, or give it as "prompt")'
            )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for key, completion in zip(SIDES, (chosen, rejected), strict=True):
        if not any(c.strip() for _, c in completion):
            raise ChatError(f'"{key}": empty completion (no messages after the prompt, or only empty ones)')
    return Pair(prompt, chosen, rejected)


class PairRenderer:
    """A row to its two documents (chosen, rejected) as segments with role codes.

    `render` is the chat renderer wrapped by `with_ends`, or the UserError that building it raised
    (no ChatML tokens, no template): standard pairs need none, so that error is raised only when a
    conversation comes, for the whole run, not as a bad row."""

    def __init__(
        self,
        bos: int | None,
        eos: int | None,
        render: Callable[[Messages], list[Segment]] | UserError,
    ) -> None:
        self.bos, self.eos, self.render = bos, eos, render

    def __call__(self, row: object) -> list[list[Segment]]:
        pair = pair_of(row)
        if isinstance(pair.prompt, str):
            return [self._standard(pair.prompt, side) for side in (pair.chosen, pair.rejected)]
        return [self._conversation(pair.prompt, side) for side in (pair.chosen, pair.rejected)]

    def _standard(self, prompt: str, completion: str) -> list[Segment]:
        """Prompt and completion encoded apart (text segments are), as TRL encodes them."""
        bos = [Segment(None, self.bos, 0)] if self.bos is not None else []
        eos = [Segment(None, self.eos, COMPLETION)] if self.eos is not None else []
        return [*bos, Segment(prompt, None, ROLE_CODES["user"]), Segment(completion, None, COMPLETION), *eos]

    def _conversation(self, prompt: Messages, completion: Messages) -> list[Segment]:
        """prompt + completion rendered as one conversation; the completion's messages (their
        contents and end markers) re-marked COMPLETION, the template's text between them left 0."""
        if isinstance(self.render, UserError):
            raise self.render
        segments = self.render([*prompt, *completion])
        for s in segments:
            if s.message is not None and s.message >= len(prompt):
                s.role = COMPLETION
        return segments
