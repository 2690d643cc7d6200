"""Conversations to token segments with a role per token, for `--format chat`.

Accepted lines: `{"messages": [{"role": ..., "content": ...}, ...]}` (any number of turns) and
Megatron-LLM's `{"system": ..., "question": ..., "answer": ...}` (system optional).

A conversation is rendered to *segments*: text to encode, or a token id (a template marker such as
`<|im_start|>`). Message contents are always encoded as raw text, so a user writing "<|im_end|>"
or "<s>" gets text tokens, never the marker. Every piece carries a role code; the role sidecar
holds one code per token so training can put the loss on assistant tokens only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megacore.tokenizer_files import CHATML_END, CHATML_START  # noqa: F401 (this tool's chat vocabulary)

ROLE_CODES: dict[str, int] = {"template": 0, "system": 1, "user": 2, "assistant": 3, "tool": 4}
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A conversation that cannot be used; the message names the field."""


@dataclass
class Segment:
    text: str | None  # text to encode, or None for a token id
    token: int | None
    role: int


def _type(v: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def messages_of(obj: object) -> list[tuple[str, str]]:
    """(role, content) pairs of one jsonl record, validated."""
    if not isinstance(obj, dict):
        raise ChatError(f"expected a JSON object, got {_type(obj)}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ChatError('"messages" must be a non-empty array')
        out = []
        for i, m in enumerate(msgs):
            at = f"messages[{i}]"
            if not isinstance(m, dict):
                raise ChatError(f"{at}: expected an object with role and content, got {_type(m)}")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise ChatError(f"{at}.role: missing or not a string")
            if role not in ROLES:
                raise ChatError(f"{at}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
            if not isinstance(content, str):
                raise ChatError(f"{at}.content: missing or not a string (got {_type(content)})")
            out.append((role, content))
        if not any(c.strip() for _, c in out):
            raise ChatError("empty conversation: every message content is empty")
        return out
    if "question" in obj or "answer" in obj:
        out = []
        for key, role in (("system", "system"), ("question", "user"), ("answer", "assistant")):
            v = obj.get(key)
            if v is None and key == "system":
                continue
            if not isinstance(v, str):
                raise ChatError(f'"{key}": missing or not a string (got {_type(v)})')
            if key != "system" and not v.strip():
                raise ChatError(f'"{key}": empty')
            out.append((role, v))
        return out
    raise ChatError('no "messages" array and no "question"/"answer" keys')


def render_chatml(msgs: list[tuple[str, str]], start_id: int, end_id: int) -> list[Segment]:
    """`<|im_start|>role\\ncontent<|im_end|>\\n` per message. The header and newlines are template
    (role 0); the content and its `<|im_end|>` belong to the message, so an assistant-only loss
    teaches the model to close its turn."""
    segments = []
    for role, content in msgs:
        code = ROLE_CODES[role]
        segments += [
            Segment(None, start_id, 0),
            Segment(f"{role}\n", None, 0),
            Segment(content, None, code),
            Segment(None, end_id, code),
            Segment("\n", None, 0),
        ]
    return segments


_SENTINEL = "\ue000MEGA{}\ue001"
_SENTINEL_RE = re.compile("\ue000MEGA(\\d+)\ue001")


class TemplateRenderer:
    """The tokenizer's own chat template (jinja), rendered the way transformers does, with every
    message content replaced by a sentinel so contents are encoded as raw text and the template's
    own special-token strings become their ids."""

    def __init__(self, template: str, specials: dict[str, int], bos: str | None, eos: str | None) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str) -> None:
            raise ChatError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"the tokenizer's chat template does not compile ({e})") from None
        self.specials = specials
        self.bos, self.eos = bos or "", eos or ""
        names = sorted(specials, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def render(self, msgs: list[tuple[str, str]]) -> list[Segment]:
        for _, c in msgs:
            if "\ue000" in c:
                raise ChatError("content contains U+E000, which this tool reserves")
        fake = [{"role": r, "content": _SENTINEL.format(i)} for i, (r, _) in enumerate(msgs)]
        try:
            text = self.template.render(
                messages=fake, add_generation_prompt=False, bos_token=self.bos, eos_token=self.eos
            )
        except ChatError:
            raise
        except Exception as e:
            raise ChatError(f"chat template failed: {e}") from None
        segments: list[Segment] = []
        last_content_role = None
        for i, part in enumerate(_SENTINEL_RE.split(text)):
            if i % 2 == 1:  # a message's content
                role, content = msgs[int(part)]
                segments.append(Segment(content, None, ROLE_CODES[role]))
                last_content_role = ROLE_CODES[role]
                continue
            for j, sub in enumerate(self.split.split(part) if self.split else [part]):
                if not sub:
                    continue
                if j % 2 == 1:
                    # The end marker right after a message belongs to it (the model learns to stop).
                    role = last_content_role if last_content_role is not None else 0
                    segments.append(Segment(None, self.specials[sub], role))
                    last_content_role = None
                else:
                    segments.append(Segment(sub, None, 0))
                    if sub.strip():
                        last_content_role = None
        return segments
