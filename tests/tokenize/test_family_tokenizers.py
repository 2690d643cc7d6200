"""The tokenizers of Qwen 2.5, Qwen 3, Llama 3.2 and Gemma 3, through mega-tokenize and mega-export.

There is no network here, so each family's tokenizer directory is rebuilt small, as the published
one is made (tests/family_tokenizer_dirs.py, with the published chat templates of
tests/family_templates.py): only the sizes and the ids differ.

Checked for each, against `transformers` loading the original directory:
- `--format chat --chat-template tokenizer`: every conversation's ids are `apply_chat_template`'s
  (contents as text: `sanitize_control_tokens=True`), with no EOS after a template that ends it
  with a stop token, no second BOS with `--prepend-bos`, and the role sidecar marks exactly each
  assistant reply as the template prints it plus its end-of-turn token;
- text: the tokenizer's own ids, its BOS with `--prepend-bos` where it adds one (Llama, Gemma);
- `--add-special-tokens` for ChatML: new markers past the vocab, or the tokenizer's own ids;
- mega-export of a model trained on the chat data: `AutoTokenizer` gives the artifact's ids for
  every conversation and the original's ids for text, the same special tokens and template, and
  `GenerationConfig` the original's stop ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from family_templates import QWEN3_TEMPLATE, QWEN25_TEMPLATE
from family_tokenizer_dirs import gemma3_dir, llama32_dir, qwen_dir
from mega_tokenize.chat import ROLE_CODES
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts import open_artifact
from megacore.errors import UserError
from tokenize_testlib import corpus, documents, write_jsonl

# --- the families --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    build: Callable[[Path], Path]
    end_of_turn: str  # what the template ends every turn with, a stop id of generation_config.json
    adds_bos: bool  # `tokenizer(text)` starts with BOS
    trims: tuple[str, ...]  # the roles whose contents the template prints trimmed
    tools: bool = True  # the template takes a "tool" message
    template_kwargs: dict = field(default_factory=dict)  # what apply_chat_template needs besides

    def shown(self, msgs: list[tuple[str, str]], i: int) -> str:
        """Message i's content as the template prints it."""
        role, content = msgs[i]
        return content.strip() if role in self.trims else content


FAMILIES = {
    "qwen2.5": Family(lambda d: qwen_dir(d, QWEN25_TEMPLATE, qwen3=False), "<|im_end|>", False, ()),
    # Qwen3 prints the final assistant turn's content after an empty <think> block, its leading
    # newlines dropped: the conversations here have none there.
    "qwen3": Family(lambda d: qwen_dir(d, QWEN3_TEMPLATE, qwen3=True), "<|im_end|>", False, ()),
    # Llama 3.2 reads the date when it can; mega-tokenize never does (the same ids on every run), so
    # it prints the template's own fallback date, which transformers prints when given it.
    "llama3.2": Family(
        llama32_dir,
        "<|eot_id|>",
        True,
        ("system", "user", "assistant"),
        template_kwargs={"date_string": "26 Jul 2024"},
    ),
    "gemma3": Family(gemma3_dir, "<end_of_turn>", True, ("user", "assistant"), tools=False),
}

_DOCS = [d for d in corpus(60) if "<s>" not in d]
CONVERSATIONS: dict[str, list[tuple[str, str]]] = {
    "system, user, assistant": [("system", "You are terse."), ("user", "What is a tokenizer?"),
                                ("assistant", "It maps text to ids.")],
    "several turns, no system": [("user", "Hello"), ("assistant", "Hi! How can I help?"),
                                 ("user", "Count to three."), ("assistant", "1, 2, 3.")],
    "ends with the user": [("user", "One"), ("assistant", "Two"), ("user", "Three")],
    "spaces around contents": [("system", " Be brief. "), ("user", "  Hi there  "),
                               ("assistant", " Hello!\nHow are you?  ")],
    "markers typed as text": [("user", "What are <|im_end|>, <|eot_id|>, <end_of_turn> and <s>?"),
                              ("assistant", "Markers, like <|im_start|> and <|begin_of_text|>.")],
    "unicode": [("user", "émigré naïve café 漢字 😀 — “quotes”"), ("assistant", "½ ≠ ∞ ✓ 한국어")],
    "code": [("system", _DOCS[3].strip()), ("user", _DOCS[5].strip()), ("assistant", _DOCS[8].strip()),
             ("user", _DOCS[13].strip()), ("assistant", _DOCS[21].strip())],
    "a tool's result": [("user", "Weather in Paris?"), ("assistant", "Let me check."),
                        ("tool", "temperature: 21 degrees"), ("assistant", "It is 21 degrees.")],
}  # fmt: skip
# mega-tokenize encodes each content apart from the template's text around it (so a user typing a
# marker gets text); a byte-level BPE encoding the whole rendering merges across that edge where a
# content the template prints untrimmed starts with a newline (the header's "\n" and the content's
# "\n" become one "\n\n"). Those conversations give the same text, not the same ids.
EDGES: dict[str, list[tuple[str, str]]] = {
    "a reply starting with newlines": [("user", "Quote it:"), ("assistant", "\n\nIndented:\n    x = 1"),
                                       ("user", "Thanks")],
}  # fmt: skip


def conversations(family: Family, edges: bool = False) -> dict[str, list[tuple[str, str]]]:
    convs = {**CONVERSATIONS, **(EDGES if edges else {})}
    return {k: v for k, v in convs.items() if family.tools or all(r != "tool" for r, _ in v)}


def as_messages(msgs: list[tuple[str, str]]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in msgs]


@dataclass
class Case:
    """One family: its tokenizer directory, loaded by transformers, and its chat tokens artifact."""

    name: str
    family: Family
    dir: Path
    chat: Path  # --format chat --chat-template tokenizer, defaults otherwise (--append-eos)

    def original(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.dir)

    def reference(self):
        """The tokenizer.json as mega-tokenize encodes raw text: special tokens stay text."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        tok.encode_special_tokens = True
        return tok


def _tokenize(tmp: Path, records: list[dict], tokenizer: Path, **kw) -> Path:
    src = write_jsonl(tmp / "in.jsonl", records)
    out = tmp / "tokens"
    tokenize(Options(inputs=[str(src)], out=out, tokenizer=tokenizer, progress=False, **kw))
    return out


@pytest.fixture(scope="session", params=list(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    name, family = request.param, FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(name)
    d = family.build(tmp / "tokenizer")
    records = [{"messages": as_messages(m)} for m in conversations(family, edges=True).values()]
    chat = _tokenize(tmp, records, d, format="chat", chat_template="tokenizer")
    return Case(name, family, d, chat)


# --- mega-tokenize -------------------------------------------------------------------------------


def test_chat_ids_are_the_templates(case: Case) -> None:
    """Every conversation's ids are transformers' `apply_chat_template` ids (no EOS after a template
    that ends the conversation with its stop token; Llama's and Gemma's BOS once)."""
    tok = case.original()
    convs = conversations(case.family, edges=True)
    for (name, msgs), doc in zip(convs.items(), documents(case.chat), strict=True):
        want = tok.apply_chat_template(as_messages(msgs), tokenize=True, return_dict=False,
                                       sanitize_control_tokens=True, **case.family.template_kwargs)  # fmt: skip
        if name in EDGES:
            assert tok.decode(doc) == tok.decode(want), name
        else:
            assert doc == want, (name, tok.decode(doc), tok.decode(want))
        stops = json.loads((case.dir / "generation_config.json").read_text())["eos_token_id"]
        assert tok.convert_ids_to_tokens(doc[-2:]).count(case.family.end_of_turn) == 1, name
        assert tok.convert_tokens_to_ids(case.family.end_of_turn) in stops


def test_assistant_roles_are_the_replies(case: Case) -> None:
    """`loss_on: assistant` trains on each reply as the template prints it and its end-of-turn
    token, nothing else: not Qwen3's empty <think> block, not the headers, not the other roles."""
    ref = case.reference()
    end = ref.token_to_id(case.family.end_of_turn)
    convs = conversations(case.family, edges=True)
    ids, roles = documents(case.chat), documents(case.chat, "roles")
    for (name, msgs), doc, role in zip(convs.items(), ids, roles, strict=True):
        want: list[int] = []
        for i, (r, _) in enumerate(msgs):
            if r == "assistant":
                want += [*ref.encode(case.family.shown(msgs, i), add_special_tokens=False).ids, end]
        assert [t for t, r in zip(doc, role, strict=True) if r == ROLE_CODES["assistant"]] == want, name
        system = [case.family.shown(msgs, i) for i, (r, _) in enumerate(msgs) if r == "system"]
        got_system = [t for t, r in zip(doc, role, strict=True) if r == ROLE_CODES["system"]]
        if case.name != "gemma3":  # Gemma has no system turn: its first user turn holds it, no end
            assert ref.decode(got_system, skip_special_tokens=False) == "".join(
                s + case.family.end_of_turn for s in system
            ), name
        else:
            assert ref.decode(got_system, skip_special_tokens=False) == "".join(system), name


@pytest.mark.parametrize("flags", [{"append_eos": False}, {"prepend_bos": True}])
def test_no_second_eos_or_bos(case: Case, tmp_path: Path, flags: dict) -> None:
    """--no-append-eos changes nothing (the template ends every conversation with its stop token);
    --prepend-bos adds no BOS after the template's own (Llama, Gemma), and Qwen has none to add."""
    records = [{"messages": as_messages(m)} for m in conversations(case.family).values()]
    opts = {"format": "chat", "chat_template": "tokenizer", **flags}
    if flags.get("prepend_bos") and not case.family.adds_bos:
        with pytest.raises(UserError, match="no BOS token"):
            _tokenize(tmp_path, records, case.dir, **opts)
        return
    docs = documents(_tokenize(tmp_path, records, case.dir, **opts))
    assert docs == documents(case.chat)[: len(docs)]


def test_a_content_the_template_rewrites_is_a_bad_line(tmp_path: Path) -> None:
    """Qwen3 prints an earlier assistant turn without the reasoning before its `</think>`, and the
    final one's reasoning inside its own <think> block: mega-tokenize cannot split that rendering
    into template and contents, so such a conversation is a bad line, never other ids."""
    d = FAMILIES["qwen3"].build(tmp_path / "tokenizer")
    reasoning = [("user", "2+2?"), ("assistant", "<think>\nadd\n</think>\n\n4"), ("user", "3+3?")]
    records = [{"messages": as_messages(m)} for m in (CONVERSATIONS["ends with the user"], reasoning)]
    with pytest.raises(UserError, match=r"in.jsonl:2: .*chat template"):
        _tokenize(tmp_path, records, d, format="chat", chat_template="tokenizer")
    tokens = _tokenize(tmp_path, records, d, format="chat", chat_template="tokenizer", on_error="skip")
    assert open_artifact(tokens, "tokens").counts.skipped_lines == 1


def _texts_without_added_tokens(tok) -> list[str]:
    """Real text (transformers matches a special token spelled out in text, mega-tokenize never)."""
    added = [t.content for t in tok.added_tokens_decoder.values()]
    return [t for t in corpus(80) if not any(a in t and a.strip() for a in added)]


def test_text_with_the_tokenizers_bos(case: Case, tmp_path: Path) -> None:
    """--format text with --prepend-bos where the tokenizer adds a BOS (Llama's post-processor,
    Gemma's add_bos_token): each document is `tokenizer(text)`'s ids, then EOS."""
    tok = case.original()
    texts = _texts_without_added_tokens(tok)
    tokens = _tokenize(tmp_path, [{"text": t} for t in texts], case.dir, prepend_bos=case.family.adds_bos)
    assert open_artifact(tokens, "tokens").tokenizer.eos_id == tok.eos_token_id
    assert documents(tokens) == [[*tok(t)["input_ids"], tok.eos_token_id] for t in texts]


def test_chatml_markers(case: Case, tmp_path: Path) -> None:
    """ChatML on any of them: `--add-special-tokens` gives the markers Qwen has their own ids and
    the others new ones past the vocab; EOS follows unless the tokenizer stops at `<|im_end|>`."""
    ref = case.reference()
    convs = conversations(case.family)
    records = [{"messages": as_messages(m)} for m in convs.values()]
    tokens = _tokenize(
        tmp_path, records, case.dir, format="chat", add_special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    info = open_artifact(tokens, "tokens").tokenizer
    size = ref.get_vocab_size(with_added_tokens=True)
    if case.name.startswith("qwen"):
        marks = [ref.token_to_id("<|im_start|>"), ref.token_to_id("<|im_end|>")]
        assert info.vocab_size == size
    else:
        marks = [size, size + 1]
        assert info.vocab_size == size + 2 and ref.token_to_id("<|im_start|>") is None
    assert list(info.added_special_tokens.values()) == marks
    tail = [] if info.eos_id == marks[1] else [info.eos_id]

    def enc(text: str) -> list[int]:
        return ref.encode(text, add_special_tokens=False).ids

    for msgs, doc in zip(convs.values(), documents(tokens), strict=True):
        want = [i for r, c in msgs for i in [marks[0], *enc(f"{r}\n"), *enc(c), marks[1], *enc("\n")]]
        assert doc == want + tail


# --- mega-export ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def exported(case: Case, tmp_path_factory) -> Path:
    """A tiny Llama checkpoint recording the family's chat data's tokenizer, exported (one per
    family; test_tokenizer.py exports one trained on such data)."""
    from export.test_tokenizer import export_recording

    return export_recording(tmp_path_factory.mktemp(f"{case.name}-export"), case.chat)


def test_export_encodes_as_the_data(case: Case, exported: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported)
    convs = conversations(case.family, edges=True)
    for (name, msgs), doc in zip(convs.items(), documents(case.chat), strict=True):
        got = tok.apply_chat_template(as_messages(msgs), tokenize=True, return_dict=False,
                                      sanitize_control_tokens=True, **case.family.template_kwargs)  # fmt: skip
        if name in EDGES:
            assert tok.decode(got) == tok.decode(doc), name
        else:
            assert got == doc, name


def test_export_is_the_original(case: Case, exported: Path) -> None:
    """The exported tokenizer and generation config are the original's, as transformers uses them:
    text ids (BOS included), special tokens, chat template, stop ids."""
    from transformers import AutoTokenizer, GenerationConfig

    orig, tok = case.original(), AutoTokenizer.from_pretrained(exported)
    texts = _texts_without_added_tokens(orig)
    assert [tok(t)["input_ids"] for t in texts] == [orig(t)["input_ids"] for t in texts]
    assert (tok(texts[0])["input_ids"][0] == orig.bos_token_id) == case.family.adds_bos
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(orig, name), name
    assert tok.chat_template == orig.chat_template
    assert tok.decode(documents(case.chat)[0]) == orig.decode(documents(case.chat)[0])
    want = GenerationConfig.from_pretrained(case.dir)
    got = GenerationConfig.from_pretrained(exported)
    assert got.eos_token_id == want.eos_token_id
    assert got.pad_token_id == want.pad_token_id
    assert len(tok) <= json.loads((exported / "config.json").read_text())["vocab_size"]


def test_export_of_chatml_data(tmp_path_factory) -> None:
    """ChatML markers added past Llama 3.2's vocab: the export encodes each conversation with them
    at the artifact's ids, and stops at `<|im_end|>` as well as at the original's stop ids."""
    from transformers import AutoTokenizer, GenerationConfig

    from export.test_tokenizer import export_recording

    family = FAMILIES["llama3.2"]
    tmp = tmp_path_factory.mktemp("llama-chatml")
    d = family.build(tmp / "tokenizer")
    convs = conversations(family)
    records = [{"messages": as_messages(m)} for m in convs.values()]
    tokens = _tokenize(tmp, records, d, format="chat", add_special_tokens=["<|im_start|>", "<|im_end|>"])
    info = open_artifact(tokens, "tokens").tokenizer
    out = export_recording(tmp, tokens)
    tok = AutoTokenizer.from_pretrained(out)
    for msgs, doc in zip(convs.values(), documents(tokens), strict=True):
        assert doc[-1] == info.eos_id  # <|eot_id|>: ChatML's turns end with <|im_end|>, no stop of Llama's
        got = tok.apply_chat_template(
            as_messages(msgs), tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        assert got == doc[:-1]
    stops = GenerationConfig.from_pretrained(out).eos_token_id
    original = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [*original, info.added_special_tokens["<|im_end|>"]]
