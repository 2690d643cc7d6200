"""A run's options checked and resolved into a `Job`: the files, the tokenizer, how documents are
parsed and wrapped, and the recipe that decides whether an existing output is reused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

import msgspec

from mega_tokenize.chat import CHATML_END, CHATML_START, TemplateRenderer, render_chatml, with_ends
from mega_tokenize.hf_datasets import DatasetSource, dataset_kind, open_dataset
from mega_tokenize.inputs import (
    LineBatch,
    RowBatch,
    check_columns,
    expand_inputs,
    file_schema,
    is_columnar,
    preference_columns,
    prompt_columns,
)
from mega_tokenize.parsing import (
    Parsed,
    RecordParser,
    Skips,
    TextParser,
    chat_documents,
    parsed_batches,
    stream_sizes,
)
from mega_tokenize.preference import PairRenderer
from mega_tokenize.prompts import PromptRenderer
from mega_tokenize.shards import safe_name
from mega_tokenize.tokenizer import Tokenizer, load_tokenizer, set_threads
from megacore.artifacts import manifest as mf
from megacore.artifacts.output import recipe_sha256
from megacore.data.indexed import token_dtype
from megacore.errors import UserError

DEFAULT_KEYS = {"text": ["text"], "chat": ["messages"]}  # jsonl key / Parquet or dataset column read
Format = Literal["text", "chat", "preference", "prompts"]
# The formats whose rows name their own keys (no --json-key).
FIXED_KEYS = {
    "preference": "prompt, chosen and rejected",
    "prompts": "prompt, and keep every other key as a column",
}


@dataclass
class Options:
    inputs: list[str]
    out: Path
    tokenizer: Path
    json_keys: list[str] = field(default_factory=list)  # [] : DEFAULT_KEYS of the format
    format: Format = "text"
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
    subset: str | None = None  # of a Hugging Face dataset: its config (None: its default)
    split: str | None = None  # of a Hugging Face dataset (None: train, or a saved Dataset's own)


@dataclass
class Job:
    """A checked run: its inputs, tokenizer, output layout and recipe."""

    opts: Options
    files: list[Path]  # read as files (a save_to_disk dataset's Arrow files among them)
    dataset: DatasetSource | None  # the Hugging Face dataset the input is, if it is one
    tok: Tokenizer
    settings: dict
    inputs: list[mf.InputFile]
    recipe: str
    keys: list[str]  # one shard per key ("chat" for conversations, "preference" for pairs)
    columns: dict[Path, list[str]]  # what is read of each Parquet or Arrow file (the json keys as columns)
    stream_columns: list[str]  # what is read of a dataset streamed by `datasets`
    dtype: str
    bos: int | None
    eos: int | None
    parse: Callable[[LineBatch | RowBatch], Parsed]
    skips: Skips
    template: str | None

    def parsed(self, parallel: int) -> Iterator[Parsed]:
        """The input's batches, parsed, in order: its files, or the dataset `datasets` streams."""
        opts = self.opts
        if self.dataset is not None and self.dataset.stream is not None:
            rows = self.dataset.rows(self.stream_columns, stream_sizes(opts.batch_bytes, parallel))
            return map(self.parse, rows)
        return parsed_batches(self.files, self.parse, self.skips, opts.batch_bytes, parallel, self.columns)


def prepare(opts: Options) -> Job:
    """Every option check, the tokenizer, and the recipe that decides whether an output is reused."""
    opts = _checked(opts)
    set_threads(opts.workers)
    files, dataset = _sources(opts)
    columns = {f: _columns(file_schema(f), str(f), opts) for f in files if is_columnar(f)}
    stream_columns = _columns(dataset.schema, dataset.label, opts) if dataset and dataset.stream else []
    tok = load_tokenizer(opts.tokenizer, threads=opts.workers)
    if opts.add_special_tokens:
        tok.add_special_tokens(opts.add_special_tokens)
    if opts.append_eos and tok.eos_id is None:
        raise UserError("the tokenizer has no EOS token; pass --no-append-eos", str(opts.tokenizer))
    if opts.prepend_bos and tok.bos_id is None:
        raise UserError("the tokenizer has no BOS token; drop --prepend-bos", str(opts.tokenizer))
    keys = opts.json_keys if opts.format == "text" else [opts.format]
    names = [safe_name(k) for k in keys]
    if len(set(names)) != len(names) or "chat.roles" in names:
        raise UserError(f"keys {keys} would share an output file name; rename them", "--json-key")
    skips = Skips(opts.on_error)
    bos = tok.bos_id if opts.prepend_bos else None
    eos = tok.eos_id if opts.append_eos else None
    parse, template = _parser(opts, tok, skips, bos, eos)
    if opts.format != "text":
        bos = eos = None  # a document's BOS and EOS come with its segments (with_ends, PairRenderer)
    settings = _settings(opts, tok)
    inputs = _inputs(dataset.files if dataset else files)
    # A dataset's identity (path, revision, subset, split) is part of the recipe; file inputs'
    # recipes stay as they were.
    identity = {"dataset": msgspec.structs.asdict(dataset.record)} if dataset else {}
    return Job(
        opts=opts,
        files=files,
        dataset=dataset,
        tok=tok,
        settings=settings,
        inputs=inputs,
        recipe=recipe_sha256(
            settings=settings, inputs=[msgspec.structs.asdict(i) for i in inputs], **identity
        ),
        keys=keys,
        columns=columns,
        stream_columns=stream_columns,
        dtype=token_dtype(tok.vocab_size),
        bos=bos,
        eos=eos,
        parse=parse,
        skips=skips,
        template=template,
    )


def _checked(opts: Options) -> Options:
    """The options checked on their own, the format's default keys filled in."""
    if opts.workers < 1:
        raise UserError("must be at least 1", "--workers")
    if opts.format in FIXED_KEYS:
        if opts.json_keys:
            raise UserError(
                f"--format {opts.format} reads the keys (Parquet: columns) {FIXED_KEYS[opts.format]}; "
                "drop --json-key",
                "--json-key",
            )
        # A prompt ends where the model writes on: no EOS (recorded so).
        return replace(opts, append_eos=False) if opts.format == "prompts" else opts
    opts = replace(opts, json_keys=opts.json_keys or DEFAULT_KEYS[opts.format])
    if len(set(opts.json_keys)) != len(opts.json_keys):
        raise UserError("the same key is given twice", "--json-key")
    if opts.format == "chat" and len(opts.json_keys) > 1:
        raise UserError("--format chat reads one key, the messages", "--json-key")
    return opts


def _sources(opts: Options) -> tuple[list[Path], DatasetSource | None]:
    """The files read, and the Hugging Face dataset the input is (one, alone), if it is one."""
    kinds = [dataset_kind(spec) for spec in opts.inputs]
    if not any(kinds):
        if opts.subset is not None or opts.split is not None:
            raise UserError(
                "chooses within a Hugging Face dataset (hf://datasets/ORG/NAME, a save_to_disk or a "
                "dataset repository's directory); these inputs are files",
                "--split" if opts.split is not None else "--subset",
            )
        return expand_inputs(opts.inputs), None
    if len(opts.inputs) > 1:
        spec = opts.inputs[next(i for i, k in enumerate(kinds) if k)]
        raise UserError("a Hugging Face dataset is read alone: give it as the only input", spec)
    dataset = open_dataset(opts.inputs[0], opts.subset, opts.split)
    return (dataset.files if dataset.stream is None else []), dataset


def _columns(schema, where: str, opts: Options) -> list[str]:
    """The columns read of a Parquet or Arrow file, or a dataset, its schema checked first."""
    if opts.format == "preference":
        return preference_columns(schema, where)
    if opts.format == "prompts":
        return prompt_columns(schema, where)
    check_columns(schema, opts.json_keys, opts.format == "chat", where)
    return opts.json_keys


def _parser(
    opts: Options, tok: Tokenizer, skips: Skips, bos: int | None, eos: int | None
) -> tuple[Callable[[LineBatch | RowBatch], Parsed], str | None]:
    """How records become documents, and the chat template recorded (None: none can be rendered)."""
    if opts.format == "text":
        return TextParser(opts.json_keys, skips), None
    prompts = opts.format == "prompts"
    try:
        render, template = _chat_renderer(opts, tok)
        if prompts:  # ends where the model writes the assistant's turn: no EOS
            render, eos_after = partial(render, generation_prompt=True), None
        else:
            eos_after = eos
        # A conversation's BOS and EOS come with its rendering: none where the template put them.
        render = with_ends(render, bos, eos_after, tok.stop_ids)
    except UserError as e:
        if opts.format == "chat":
            raise
        # Standard (string) pairs and prompts need no chat template: a tokenizer without one, or
        # without ChatML's tokens, is refused at the first conversation only.
        render, template = e, None
    if opts.format == "chat":
        return RecordParser(chat_documents(render, opts.json_keys[0]), skips), template
    if prompts:
        return RecordParser(PromptRenderer(bos, render), skips, PromptRenderer.columns), template
    return RecordParser(PairRenderer(bos, eos, render), skips), template


def _settings(opts: Options, tok: Tokenizer) -> dict:
    """What the ids depend on besides the inputs (with them, the artifact's recipe)."""
    keys = opts.json_keys or DEFAULT_KEYS.get(opts.format, [])
    if opts.format == "chat" and keys == DEFAULT_KEYS["chat"]:
        keys = []  # the default messages key is not recorded: earlier chat recipes stay the same
    return {
        "tokenizer": tok.fingerprint(),
        "format": opts.format,
        "json_keys": keys,
        "chat_template": opts.chat_template if opts.format != "text" else None,
        "append_eos": opts.append_eos,
        "prepend_bos": opts.prepend_bos,
        "added": tok.added,
        "on_error": opts.on_error,
        **({"stop_ids": tok.stop_ids} if tok.stop_ids else {}),  # recipes without them as before
        # Conversations rendered as transformers renders them, ends not doubled (since 0.2): an
        # artifact of the earlier rendering is not reused as if it were this one.
        **({"chat_rendering": 2} if opts.format != "text" else {}),
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
        return partial(render_chatml, start_id=start, end_id=end), "chatml"
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
