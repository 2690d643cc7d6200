"""Conversations to token segments with a role per token, for `--format chat`.

Accepted lines: `{"messages": [{"role": ..., "content": ...}, ...]}` (any number of turns) and
Megatron-LLM's `{"system": ..., "question": ..., "answer": ...}` (system optional).

A conversation is rendered to *segments*: text to encode, or a token id (a template marker such as
`<|im_start|>`). Message contents are always encoded as raw text, so a user writing "<|im_end|>"
or "<s>" gets text tokens, never the marker. Every piece carries a role code; the role sidecar
holds one code per token so training can put the loss on assistant tokens only.

ChatML (`render_chatml`) or the tokenizer's own jinja template (`TemplateRenderer`: the text
transformers' `apply_chat_template` renders, split into the template's text and markers and each
content as the template prints it); `with_ends` then adds BOS and EOS where the rendering has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
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
    # The message whose content (or end marker) this is, None for the template's own text: a
    # preference pair re-marks its completion's messages (preference.py).
    message: int | None = None


def json_type(v: object) -> str:
    """A decoded JSON value's type as a message names it: "a string", "an array", ..."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def messages_of(obj: object) -> list[tuple[str, str]]:
    """(role, content) pairs of one jsonl record, validated."""
    if not isinstance(obj, dict):
        raise ChatError(f"expected a JSON object, got {json_type(obj)}")
    if "messages" in obj:
        out = message_list(obj["messages"], "messages")
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
                raise ChatError(f'"{key}": missing or not a string (got {json_type(v)})')
            if key != "system" and not v.strip():
                raise ChatError(f'"{key}": empty')
            out.append((role, v))
        return out
    raise ChatError('no "messages" array and no "question"/"answer" keys')


def message_list(msgs: object, key: str) -> list[tuple[str, str]]:
    """(role, content) pairs of a non-empty array of {"role", "content"} objects (other fields
    ignored), validated; an error names `key` and the message's index."""
    if not isinstance(msgs, list) or not msgs:
        raise ChatError(f'"{key}" must be a non-empty array')
    out = []
    for i, m in enumerate(msgs):
        at = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{at}: expected an object with role and content, got {json_type(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ChatError(f"{at}.role: missing or not a string")
        if role not in ROLES:
            raise ChatError(f"{at}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ChatError(f"{at}.content: missing or not a string (got {json_type(content)})")
        out.append((role, content))
    return out


def render_chatml(
    msgs: list[tuple[str, str]], start_id: int, end_id: int, generation_prompt: bool = False
) -> list[Segment]:
    """`<|im_start|>role\\ncontent<|im_end|>\\n` per message. The header and newlines are template
    (role 0); the content and its `<|im_end|>` belong to the message, so an assistant-only loss
    teaches the model to close its turn. `generation_prompt` ends with the assistant's header, where
    the model writes its turn (a prompt for online RL)."""
    segments = []
    for i, (role, content) in enumerate(msgs):
        code = ROLE_CODES[role]
        segments += [
            Segment(None, start_id, 0),
            Segment(f"{role}\n", None, 0),
            Segment(content, None, code, i),
            Segment(None, end_id, code, i),
            Segment("\n", None, 0),
        ]
    if generation_prompt:
        segments += [Segment(None, start_id, 0), Segment("assistant\n", None, 0)]
    return segments


_SENTINEL = "\ue000MEGA{}\ue001"
_SENTINEL_RE = re.compile("\ue000MEGA(\\d+)\ue001")


def _environment():
    """A jinja environment that renders chat templates as transformers' `apply_chat_template` does:
    the same options, extensions (`{% generation %}` renders its body), `tojson` (no HTML escaping)
    and `raise_exception`. `strftime_now` is left out on purpose: a rendering never reads the clock,
    so the same input gives the same ids on every run (a template that reads the date when it can,
    as Llama 3.x's does, falls back to its own fixed date: pass that as `date_string` to
    `apply_chat_template` to match)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}` (transformers' assistant masks): its body
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(msg: str) -> None:
        raise ChatError(f"chat template: {msg}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _as_rendered(content: str):
    """What a template may print for a message's content: the content, the content with its
    whitespace trimmed as templates do (`| trim`, Qwen3's `.lstrip('\\n')`, ...), or as JSON (Llama
    3's tool results: `| tojson`)."""
    seen = set()
    for shown in (
        content,
        content.strip(),
        content.lstrip(),
        content.rstrip(),
        content.strip("\n"),
        content.lstrip("\n"),
        content.rstrip("\n"),
        json.dumps(content, ensure_ascii=False),
    ):
        if shown not in seen:
            seen.add(shown)
            yield shown


class TemplateRenderer:
    """The tokenizer's own chat template (jinja), rendered the way transformers does, as segments:
    the template's text and its special-token strings (as their ids) around each message's content,
    which is encoded as raw text, so a user typing a marker gets text.

    A conversation is rendered twice: with a sentinel for every content, which shows where each
    one goes and what text the template puts around them, and with the contents themselves, the
    text transformers renders. Each content is then found in that text as printed (templates trim
    some: Llama 3 and Gemma 3 `| trim` them); a template whose text depends on a content in another
    way (Qwen3 drops the reasoning before a `</think>` from earlier assistant turns) is a ChatError
    for that conversation, never ids other than transformers'."""

    def __init__(
        self, template: str, specials: dict[str, int], bos: str | None, eos: str | None, **names: str | None
    ) -> None:
        import jinja2

        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"the tokenizer's chat template does not compile ({e})") from None
        self.specials = specials
        # The tokenizer's named special tokens, as transformers passes them (unset ones: undefined).
        self.names = {k: v for k, v in {"bos_token": bos, "eos_token": eos, **names}.items() if v}
        ordered = sorted(specials, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=generation_prompt,
                **self.names,
            )
        except ChatError:
            raise
        except Exception as e:
            raise ChatError(f"chat template failed: {e}") from None

    def render(self, msgs: list[tuple[str, str]], generation_prompt: bool = False) -> list[Segment]:
        """`msgs` as segments; `generation_prompt`: as `add_generation_prompt` renders them, ending
        where the model writes the assistant's turn (a prompt for online RL)."""
        for _, c in msgs:
            if "\ue000" in c:
                raise ChatError("content contains U+E000, which this tool reserves")
        sentinels = [{"role": r, "content": _SENTINEL.format(i)} for i, (r, _) in enumerate(msgs)]
        fake = self._render(sentinels, generation_prompt)
        real = self._render([{"role": r, "content": c} for r, c in msgs], generation_prompt)
        parts = _SENTINEL_RE.split(fake)
        texts, order = parts[0::2], [int(i) for i in parts[1::2]]
        shown = self._contents(real, texts, [(i, msgs[i][1]) for i in order])
        segments: list[Segment] = []
        last = None  # (role code, message) of the content printed last
        for k, text in enumerate(texts):
            last = self._template_text(text, segments, last)
            if k < len(order):
                last = (ROLE_CODES[msgs[order[k]][0]], order[k])
                if shown[k]:
                    segments.append(Segment(shown[k], None, *last))
        return segments

    @staticmethod
    def _contents(real: str, texts: list[str], contents: list[tuple[int, str]]) -> list[str]:
        """Each content (message index, content) as the template printed it, so that the
        template's texts and the contents in turn are exactly `real`; a ChatError when they cannot be."""
        if not real.startswith(texts[0]):
            raise ChatError("the chat template's text depends on the message contents; cannot split it")
        pos, shown = len(texts[0]), []
        for k, (i, content) in enumerate(contents):
            after, last = texts[k + 1], k == len(contents) - 1
            for candidate in _as_rendered(content):
                end = pos + len(candidate)
                fits = real.startswith(candidate, pos) and real.startswith(after, end)
                if fits and (not last or end + len(after) == len(real)):
                    break
            else:
                raise ChatError(
                    f"messages[{i}]: the chat template prints this content changed in a way this tool "
                    "cannot follow (not the content, trimmed or as JSON)"
                )
            shown.append(candidate)
            pos = end + len(after)
        if not contents and real != texts[0]:
            raise ChatError("the chat template's text depends on the message contents; cannot split it")
        return shown

    def _template_text(
        self, text: str, segments: list[Segment], last: tuple[int, int] | None
    ) -> tuple[int, int] | None:
        """The template's own text as segments: its special tokens as ids, the rest as text (role 0).
        The end marker right after a message (`last`: its role code and index) belongs to it (the
        model learns to stop)."""
        for j, sub in enumerate(self.split.split(text) if self.split else [text]):
            if not sub:
                continue
            if j % 2 == 1:
                role, message = last if last is not None else (0, None)
                segments.append(Segment(None, self.specials[sub], role, message))
                last = None
            else:
                segments.append(Segment(sub, None, 0))
                if sub.strip():
                    last = None
        return last


def with_ends(
    render: Callable[[list[tuple[str, str]]], list[Segment]],
    bos: int | None,
    eos: int | None,
    stop_ids: Iterable[int] = (),
) -> Callable[[list[tuple[str, str]]], list[Segment]]:
    """`render` with BOS before and EOS after every conversation (`--prepend-bos`, `--append-eos`),
    where the rendering has none already: no second BOS after a template's own, and no EOS after a
    conversation that ends with one of the tokenizer's stop tokens (its EOS, or an id its
    generation_config.json stops at: `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), whitespace after
    it aside. Those templates end every turn with the token generation stops at; an EOS after it
    would teach the model a token it never gets to emit."""
    stops = {i for i in (eos, *stop_ids) if i is not None}

    def ended(msgs: list[tuple[str, str]]) -> list[Segment]:
        segments = render(msgs)
        marks = [s for s in segments if s.text is None or s.text.strip()]
        if bos is not None and not (marks and marks[0].token == bos and segments[0] is marks[0]):
            segments.insert(0, Segment(None, bos, 0))
        if eos is not None and not (marks and marks[-1].token in stops):
            segments.append(Segment(None, eos, 0))
        return segments

    return ended
