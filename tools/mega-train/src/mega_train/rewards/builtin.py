"""The built-in reward functions, each with TRL's reward-function signature (`mega_train.rewards`).

- `math`: 1.0 when the completion's final answer (its last `\\boxed{...}`, else its last number)
  equals the row's `answer` as math-verify compares them (symbolically: 1/2, 0.5 and \\frac{1}{2}
  are one answer), else 0.0; None for a row whose answer math-verify cannot parse. TRL's
  accuracy_reward reads the first box and no bare number: otherwise the two agree.
- `exact`: 1.0 when the completion, stripped, is the row's `answer` (as text, stripped), else 0.0.
- `format`: 1.0 when the whole completion matches the regular expression `pattern` (`.` matching
  newlines too), else 0.0.
- `length`: DAPO's soft overlong punishment: 0 up to `max_length - cache` completion tokens, then
  falling linearly to -1 at `max_length`, and -1 beyond it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def completion_text(completion: Any) -> str:
    """A completion as text: itself, or the content of its last message (TRL's conversational form)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"])


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, its braces balanced (None: there is none)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The completion's final answer: its last boxed expression, else its last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def math_answer(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float | None]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = parse(str(gold))  # math-verify's own reading of a reference answer, as TRL's
        if not expected:
            out.append(None)
            continue
        found = final_answer(completion_text(completion))
        got = parse(f"${found}$", extraction_config=configs) if found is not None else []
        out.append(float(bool(got) and verify(expected, got)))
    return out


def exact_answer(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float | None]:
    return [
        float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
    ]


def format_match(completions: Sequence[Any], pattern: str, **_: Any) -> list[float | None]:
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]


def length_penalty(
    completion_ids: Sequence[Sequence[int]], max_length: int, cache: int = 0, **_: Any
) -> list[float | None]:
    soft = max_length - cache
    out: list[float | None] = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= soft else -1.0 if n >= max_length else (soft - n) / cache)
    return out


BUILTINS: dict[str, Callable[..., list[float | None]]] = {
    "math": math_answer,
    "exact": exact_answer,
    "format": format_match,
    "length": length_penalty,
}
