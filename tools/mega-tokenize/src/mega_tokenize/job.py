"""A run's options checked and resolved into a `Job`: the files, the tokenizer, how documents are
parsed and wrapped, and the recipe that decides whether an existing output is reused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import msgspec

from mega_tokenize.chat import CHATML_END, CHATML_START, TemplateRenderer, render_chatml, with_ends
from mega_tokenize.inputs import LineBatch, RowBatch, check_parquet, expand_inputs, is_parquet
from mega_tokenize.parsing import ChatParser, Parsed, Skips, TextParser
from mega_tokenize.shards import safe_name
from mega_tokenize.tokenizer import Tokenizer, load_tokenizer, set_threads
from megacore.artifacts import manifest as mf
from megacore.artifacts.output import recipe_sha256
from megacore.data.indexed import token_dtype
from megacore.errors import UserError

DEFAULT_KEYS = {"text": ["text"], "chat": ["messages"]}  # jsonl key / Parquet column read


@dataclass
class Options:
    inputs: list[str]
    out: Path
    tokenizer: Path
    json_keys: list[str] = field(default_factory=list)  # [] : DEFAULT_KEYS of the format
    format: Literal["text", "chat"] = "text"
    chat_template: Literal["chatml", "tokenizer"] = "chatml"
    append_eos: bool = True
    prepend_bos: bool = False
    add_special_tokens: list[str] = field(default_factory=list)
    engine: str = "auto"
    workers: int = 1
    on_error: Literal["fail", "skip"] = "fail"
    force: bool = False
    batch_bytes: int = 16 << 20  # the largest batch; see parsing.batch_sizes
    progress: bool = True


@dataclass
class Job:
    """A checked run: its inputs, tokenizer, output layout and recipe."""

    opts: Options
    files: list[Path]
    tok: Tokenizer
    settings: dict
    inputs: list[mf.InputFile]
    recipe: str
    keys: list[str]  # one shard per key ("chat" for conversations)
    columns: list[str]  # what is read from each record: the json keys (Parquet columns)
    dtype: str
    bos: int | None
    eos: int | None
    parse: Callable[[LineBatch | RowBatch], Parsed]
    skips: Skips
    template: str | None


def prepare(opts: Options) -> Job:
    """Every option check, the tokenizer, and the recipe that decides whether an output is reused."""
    if opts.workers < 1:
        raise UserError("must be at least 1", "--workers")
    opts = replace(opts, json_keys=opts.json_keys or DEFAULT_KEYS[opts.format])
    if len(set(opts.json_keys)) != len(opts.json_keys):
        raise UserError("the same key is given twice", "--json-key")
    if opts.format == "chat" and len(opts.json_keys) > 1:
        raise UserError("--format chat reads one key, the messages", "--json-key")
    set_threads(opts.workers)
    files = expand_inputs(opts.inputs)
    for f in files:
        if is_parquet(f):
            check_parquet(f, opts.json_keys, chat=opts.format == "chat")
    tok = load_tokenizer(opts.tokenizer, threads=opts.workers)
    if opts.add_special_tokens:
        tok.add_special_tokens(opts.add_special_tokens)
    if opts.append_eos and tok.eos_id is None:
        raise UserError("the tokenizer has no EOS token; pass --no-append-eos", str(opts.tokenizer))
    if opts.prepend_bos and tok.bos_id is None:
        raise UserError("the tokenizer has no BOS token; drop --prepend-bos", str(opts.tokenizer))
    keys = opts.json_keys if opts.format == "text" else ["chat"]
    names = [safe_name(k) for k in keys]
    if len(set(names)) != len(names) or "chat.roles" in names:
        raise UserError(f"keys {keys} would share an output file name; rename them", "--json-key")
    skips = Skips(opts.on_error)
    template = None
    bos = tok.bos_id if opts.prepend_bos else None
    eos = tok.eos_id if opts.append_eos else None
    if opts.format == "chat":
        render, template = _chat_renderer(opts, tok)
        # A conversation's BOS and EOS come with its rendering: none where the template put them.
        render, bos, eos = with_ends(render, bos, eos, tok.stop_ids), None, None
        parse: Callable[[LineBatch | RowBatch], Parsed] = ChatParser(render, skips, opts.json_keys[0])
    else:
        parse = TextParser(opts.json_keys, skips)
    settings = _settings(opts, tok)
    inputs = _inputs(files)
    return Job(
        opts=opts,
        files=files,
        tok=tok,
        settings=settings,
        inputs=inputs,
        recipe=recipe_sha256(settings=settings, inputs=[msgspec.structs.asdict(i) for i in inputs]),
        keys=keys,
        columns=opts.json_keys,
        dtype=token_dtype(tok.vocab_size),
        bos=bos,
        eos=eos,
        parse=parse,
        skips=skips,
        template=template,
    )


def _settings(opts: Options, tok: Tokenizer) -> dict:
    """What the ids depend on besides the inputs (with them, the artifact's recipe)."""
    keys = opts.json_keys or DEFAULT_KEYS[opts.format]
    if opts.format == "chat" and keys == DEFAULT_KEYS["chat"]:
        keys = []  # the default messages key is not recorded: earlier chat recipes stay the same
    return {
        "tokenizer": tok.fingerprint(),
        "format": opts.format,
        "json_keys": keys,
        "chat_template": opts.chat_template if opts.format == "chat" else None,
        "append_eos": opts.append_eos,
        "prepend_bos": opts.prepend_bos,
        "added": tok.added,
        "on_error": opts.on_error,
        **({"stop_ids": tok.stop_ids} if tok.stop_ids else {}),  # recipes without them as before
        # Conversations rendered as transformers renders them, ends not doubled (since 0.2): an
        # artifact of the earlier rendering is not reused as if it were this one.
        **({"chat_rendering": 2} if opts.format == "chat" else {}),
    }


def _inputs(files: list[Path]) -> list[mf.InputFile]:
    out = []
    for p in files:
        st = p.stat()
        out.append(mf.InputFile(path=str(p), size=st.st_size, mtime_ns=st.st_mtime_ns))
    return out


def _chat_renderer(opts: Options, tok: Tokenizer):
    if opts.chat_template == "chatml":
        start, end = tok.token_id(CHATML_START), tok.token_id(CHATML_END)
        if start is None or end is None:
            raise UserError(
                f"ChatML needs the tokens {CHATML_START} and {CHATML_END}, which this tokenizer does not "
                f"have: pass --add-special-tokens '{CHATML_START},{CHATML_END}' (the vocab grows to "
                f"{tok.vocab_size + 2}; the model's embeddings must too) or --chat-template tokenizer",
                str(opts.tokenizer),
            )
        tok.special_tokens.setdefault(CHATML_START, start)
        tok.special_tokens.setdefault(CHATML_END, end)
        return (lambda msgs: render_chatml(msgs, start, end)), "chatml"
    if not tok.chat_template:
        raise UserError(
            "--chat-template tokenizer: this tokenizer has no chat template (tokenizer_config.json "
            "chat_template); use --chat-template chatml",
            str(opts.tokenizer),
        )
    id_to_name = {v: k for k, v in tok.special_tokens.items()}
    specials = {**tok.special_tokens, **tok.added}
    try:
        r = TemplateRenderer(
            tok.chat_template,
            specials,
            id_to_name.get(tok.bos_id) if tok.bos_id is not None else None,
            id_to_name.get(tok.eos_id) if tok.eos_id is not None else None,
        )
    except ValueError as e:
        raise UserError(str(e), str(opts.tokenizer)) from None
    return r.render, tok.chat_template
