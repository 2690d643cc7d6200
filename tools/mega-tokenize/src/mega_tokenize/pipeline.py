"""Corpus files to a `tokens` artifact: read, parse, encode, write; one pass, bounded memory.

A reader thread streams and parses the input (decompression and JSON parsing in C; Parquet row
groups decoded by pyarrow into the same Python strings, see inputs.py), encoding
threads turn batches into checked, EOS/BOS-wrapped ids (the engine and numpy release the GIL;
`--workers` batches at once for gigatoken, whose calls each run on their thread), and the main
thread appends them to the shards, which hash and flush as they grow. Batches are written in input
order and a document's ids do not depend on its batch, so the shards are byte-identical for any
`--workers`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from mega_tokenize import __version__
from mega_tokenize.chat import (
    CHATML_END,
    CHATML_START,
    ROLE_CODES,
    ChatError,
    Segment,
    TemplateRenderer,
    messages_of,
    render_chatml,
    with_ends,
)
from mega_tokenize.inputs import (
    LineBatch,
    RowBatch,
    check_parquet,
    expand_inputs,
    is_parquet,
    read_lines,
    read_parquet,
)
from mega_tokenize.tokenizer import (
    Engine,
    Tokenizer,
    candidate_engine,
    load_tokenizer,
    set_threads,
    verify_engine,
)
from megacore.artifacts import ArtifactWriter, write_artifact
from megacore.artifacts import manifest as mf
from megacore.artifacts.output import recipe_sha256, reusable
from megacore.background import Background
from megacore.data.indexed import IndexedWriter, token_dtype
from megacore.errors import UserError
from megacore.progress import Progress

MAX_EXAMPLES = 10
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
    batch_bytes: int = 16 << 20  # the largest batch; see _batch_sizes
    progress: bool = True


@dataclass
class Result:
    manifest: mf.TokensManifest
    reused: bool
    seconds: float = 0.0
    input_bytes: int = 0


class _Skips:
    """Bad lines: raise (`--on-error fail`) or count them and keep the first few messages."""

    def __init__(self, mode: str) -> None:
        self.mode, self.count, self.examples = mode, 0, []

    def __call__(self, where: str, msg: str) -> None:
        if self.mode == "fail":
            raise UserError(f"{msg} (or pass --on-error skip to skip such lines)", where)
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {msg}")


# --- parsing ------------------------------------------------------------------------------------


def _json_type(v: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _line_error(line: bytes) -> tuple[Any, str | None]:
    """Decode one line; (value, None) or (None, what is wrong) with the precise reason."""
    try:
        return msgspec.json.decode(line), None
    except msgspec.DecodeError:
        pass
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 (byte {e.start})"
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    return None, "invalid Unicode (a lone surrogate escape such as \\ud800)"


@dataclass
class Parsed:
    """One batch of documents: per json key their texts (text format) or rendered pieces (chat)."""

    texts: dict[str, list[str]]
    chats: list[list[Segment]] | None
    nbytes: int


class TextParser:
    def __init__(self, keys: list[str], skips: _Skips) -> None:
        self.keys, self.skips = keys, skips
        fields = [(f"k{i}", str) for i in range(len(keys))]
        doc = msgspec.defstruct("Doc", fields, rename={f"k{i}": k for i, k in enumerate(keys)})
        self.decoder = msgspec.json.Decoder(doc)
        self.getters = [(k, f"k{i}") for i, k in enumerate(keys)]

    def __call__(self, b: LineBatch | RowBatch) -> Parsed:
        if isinstance(b, RowBatch):
            return self.rows(b)
        texts: dict[str, list[str]] = {k: [] for k in self.keys}
        try:
            docs = self.decoder.decode_lines(b.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            docs = None
        if docs is not None and len(docs) == b.nlines:
            for k, attr in self.getters:
                texts[k] = [getattr(d, attr) for d in docs]
            if all(t and not t.isspace() for ts in texts.values() for t in ts):
                return Parsed(texts, None, b.nbytes)
            texts = {k: [] for k in self.keys}
        # Slow path, only for a batch with a problem: line by line, to say which line and why.
        for n, line in enumerate(b.lines(), start=b.first_line):
            if not line.strip():
                continue  # blank lines (often a trailing one) are not documents
            obj, err = _line_error(line)
            where = f"{b.path}:{n}"
            if err is None and not isinstance(obj, dict):
                err = f"expected a JSON object, got {_json_type(obj)}"
            if err is None:
                for k in self.keys:
                    if k not in obj:
                        err = f'missing key "{k}" (choose the key with --json-key)'
                    elif not isinstance(obj[k], str):
                        err = f'key "{k}" is {_json_type(obj[k])}, expected a string'
                    elif not obj[k] or obj[k].isspace():
                        err = f'key "{k}" is an empty document'
                    if err:
                        break
            if err:
                self.skips(where, err)
                continue
            for k in self.keys:
                texts[k].append(obj[k])
        return Parsed(texts, None, b.nbytes)

    def rows(self, b: RowBatch) -> Parsed:
        """Parquet rows: the columns' strings (types were checked with the schema), nulls and empty
        documents reported as jsonl's bad lines are, by row."""
        texts = {k: b.columns[k] for k in self.keys}
        if all(t and not t.isspace() for ts in texts.values() for t in ts):
            return Parsed(texts, None, b.nbytes)
        texts = {k: [] for k in self.keys}
        for i in range(b.nrows):
            err = None
            for k in self.keys:
                v = b.columns[k][i]
                if v is None:
                    err = f'column "{k}" is null, expected a string'
                elif not v or v.isspace():
                    err = f'column "{k}" is an empty document'
                if err:
                    break
            if err:
                self.skips(b.where(b.first_row + i), err)
                continue
            for k in self.keys:
                texts[k].append(b.columns[k][i])
        return Parsed(texts, None, b.nbytes)


class ChatParser:
    """Conversations: a line's `messages` (or Megatron-LLM's question/answer), or under another key
    (`--json-key`) just the messages; a Parquet row's messages column."""

    def __init__(
        self, render: Callable[[list[tuple[str, str]]], list[Segment]], skips: _Skips, key: str = "messages"
    ) -> None:
        self.render, self.skips, self.key = render, skips, key

    def __call__(self, b: LineBatch | RowBatch) -> Parsed:
        if isinstance(b, RowBatch):
            return self.rows(b)
        chats = []
        for n, line in enumerate(b.lines(), start=b.first_line):
            if not line.strip():
                continue
            obj, err = _line_error(line)
            if err is None:
                try:
                    chats.append(self.render(messages_of(self._messages(obj))))
                    continue
                except ChatError as e:
                    err = str(e)
            self.skips(f"{b.path}:{n}", err)
        return Parsed({}, chats, b.nbytes)

    def _messages(self, obj: object) -> object:
        if self.key == "messages" or not isinstance(obj, dict):
            return obj
        if self.key not in obj:
            raise ChatError(f'missing key "{self.key}" (choose the messages key with --json-key)')
        return {"messages": obj[self.key]}

    def rows(self, b: RowBatch) -> Parsed:
        chats = []
        for i, msgs in enumerate(b.columns[self.key]):
            try:
                chats.append(self.render(messages_of({"messages": msgs})))
            except ChatError as e:
                self.skips(b.where(b.first_row + i), str(e))
        return Parsed({}, chats, b.nbytes)


MIN_BATCH = 4 << 20


def _batch_sizes(files: list[Path], max_bytes: int, parallel: int) -> list[Callable[[int], int]]:
    """Per file, the next batch's size from the bytes left in it. An engine call starts with
    cold caches, so batches are large (up to `max_bytes`: measured ~20% less engine CPU at
    16 MB than at 4 MB), but the first ones ramp up from MIN_BATCH (encoding starts at once)
    and the last ones shrink with what is left (the threads finish together, no long tail)."""
    later = [0] * len(files)  # raw bytes of the files after each one
    for i in range(len(files) - 2, -1, -1):
        later[i] = later[i + 1] + files[i + 1].stat().st_size
    lo = min(MIN_BATCH, max_bytes)
    made = 0

    def size(left_in_file: int, after: int) -> int:
        nonlocal made
        made += 1
        ramp = lo << min(made - 1, 16)
        return max(lo, min(max_bytes, ramp, (left_in_file + after) // (2 * parallel)))

    return [lambda left, after=after: size(left, after) for after in later]


def _batches(
    files: list[Path],
    parse: Callable[[LineBatch | RowBatch], Parsed],
    skips: _Skips,
    batch_bytes: int,
    parallel: int,
    columns: list[str],
):
    for path, sizes in zip(files, _batch_sizes(files, batch_bytes, parallel), strict=True):
        if is_parquet(path):
            for rows in read_parquet(path, columns, sizes):
                yield parse(rows)
            continue
        for b in read_lines(path, sizes):
            yield parse(b)
            if b.truncated:
                where = f"{path}:{b.first_line + b.nlines}"
                skips(where, b.truncated)


# --- encoding ------------------------------------------------------------------------------------


def _wrap(
    flat: np.ndarray, lengths: np.ndarray, bos: int | None, eos: int | None, dtype: str = "uint32"
) -> tuple[np.ndarray, np.ndarray]:
    """Insert BOS before and/or EOS after every document, vectorized, straight into `dtype`."""
    if bos is None and eos is None:
        return flat.astype(dtype, copy=False), lengths
    extra = (bos is not None) + (eos is not None)
    new_lengths = lengths + extra
    ends = np.cumsum(new_lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    marks = np.zeros(len(out), dtype=bool)
    if eos is not None:
        marks[ends - 1] = True
    if bos is not None:
        marks[ends - new_lengths] = True
    out[~marks] = flat  # the documents' own tokens, in order, around the marks
    if eos is not None:
        out[ends - 1] = eos
    if bos is not None:
        out[ends - new_lengths] = bos
    return out, new_lengths


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key) or "text"


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


class _EngineDisagrees(Exception):
    def __init__(self, problem: str, reference: str) -> None:
        super().__init__(problem)
        self.reference = reference


def tokenize(opts: Options, log: Callable[[str], None] | None = None) -> Result:
    """Build (or reuse) the tokens artifact at `opts.out`.

    The engine's ids are checked against the reference tokenizer on a sample of every batch while
    the run goes on (off the critical path); if they differ, nothing is committed: `auto` starts
    over with the reference, a named engine is an error."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        return _tokenize(opts, log)
    except _EngineDisagrees as e:
        if opts.engine != "auto":
            raise UserError(f"{e}; use --engine {e.reference} or auto") from None
        log(f"mega-tokenize: WARNING: {e}; starting over with {e.reference} (slower, same ids)")
        return _tokenize(replace(opts, engine=e.reference), log)


@dataclass
class _Job:
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
    skips: _Skips
    template: str | None


def _prepare(opts: Options) -> _Job:
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
    names = [_safe_name(k) for k in keys]
    if len(set(names)) != len(names) or "chat.roles" in names:
        raise UserError(f"keys {keys} would share an output file name; rename them", "--json-key")
    skips = _Skips(opts.on_error)
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
    return _Job(
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


def _tokenize(opts: Options, log: Callable[[str], None]) -> Result:
    t0 = time.perf_counter()
    job = _prepare(opts)
    out = Path(opts.out)
    if not opts.force and (old := reusable(out, "tokens", job.recipe)) is not None:
        return Result(old, reused=True, seconds=time.perf_counter() - t0)
    # The output must not be (or be inside, or contain) an input: a directory of inputs is searched
    # recursively, and a tokens artifact inside it would become input of the next run.
    policy_inputs = [*job.files, opts.tokenizer, *(Path(i) for i in opts.inputs if Path(i).is_dir())]
    with write_artifact(out, "tokens", inputs=policy_inputs, force=opts.force, recipe=job.recipe) as w:
        tok_files = _copy_tokenizer(job.tok, w)
        shards, engine, input_bytes = _encode_all(job, w, log)
        manifest = w.commit(_manifest(job, tok_files, shards, engine))
    return Result(manifest, reused=False, seconds=time.perf_counter() - t0, input_bytes=input_bytes)


def _copy_tokenizer(tok: Tokenizer, w: ArtifactWriter) -> list[str]:
    """The tokenizer's files under `tokenizer/`; a SentencePiece model always as `tokenizer.model`
    (the name Hugging Face loaders look for), whatever it was called; its directory's other files
    (tokenizer_config.json, a chat template) by their own names."""
    model = None
    if tok.type == "sentencepiece":
        model = next((f for f in tok.files if f.suffix == ".model"), tok.files[0])
    rels = []
    for f in tok.files:
        rel = "tokenizer/tokenizer.model" if f == model else f"tokenizer/{f.name}"
        w.path(rel).write_bytes(f.read_bytes())
        rels.append(rel)
    return rels


def _encode_all(
    job: _Job, w: ArtifactWriter, log: Callable[[str], None]
) -> tuple[list[mf.Shard], Engine, int]:
    """The encode loop: read and parse on a helper thread, encode on a pool, write in input order.

    A sample of every batch is checked against the reference on a thread of its own; every check
    has passed before this returns (and anything is committed)."""
    opts = job.opts
    shards = _Shards(w, job.keys, job.dtype, job.bos, job.eos, chat=opts.format == "chat")
    shown = Progress("mega-tokenize", "docs", extras=("tokens",), enabled=None if opts.progress else False)
    input_bytes = 0
    pool = checks = None
    # Engines run max(2, workers) batches at once (see Engine.concurrency).
    batches = Background.source(
        _batches(job.files, job.parse, job.skips, opts.batch_bytes, max(2, opts.workers), job.columns),
        name="mega-tokenize-reader",
    )
    try:
        engine = candidate_engine(job.tok, opts.engine, log)  # built while the reader parses the first batch
        pool = ThreadPoolExecutor(engine.concurrency, thread_name_prefix="mega-tokenize-encode")
        checks = _EngineChecks(job.tok, engine)
        encode = _Encoder(job, engine)
        for parsed, encoded in _in_order(checks.sampled(batches), encode, pool, engine.concurrency):
            ndocs, ntok = shards.write(parsed, encoded)
            shown.update(ndocs, parsed.nbytes, tokens=ntok)
            input_bytes += parsed.nbytes
        checks.passed(wait=True)  # before anything is committed
        shards.close()
    except BaseException:
        batches.cancel()
        for ex in (pool, checks):
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=True)
        shards.abort()
        raise
    pool.shutdown()
    checks.shutdown()
    shown.done()
    if shards.documents == 0:
        raise UserError(
            f"no documents in the input ({job.skips.count} lines skipped)", ", ".join(opts.inputs)
        )
    return shards.entries(), engine, input_bytes


_Encoded = dict[str, tuple[np.ndarray, np.ndarray]]  # per key: the batch's ids and each document's length


class _EngineChecks:
    """The engine's ids against the reference's on a sample of every batch, on a thread of its own
    (off the critical path)."""

    def __init__(self, tok: Tokenizer, engine: Engine) -> None:
        self.tok, self.engine = tok, engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mega-tokenize-check")
        self.pending: deque[Future] = deque()

    def sampled(self, batches: Iterable[Parsed]) -> Iterator[Parsed]:
        """Each batch once its sample is queued for the check."""
        for i, parsed in enumerate(batches):
            first = i == 0
            self.pending.append(
                self.pool.submit(verify_engine, self.tok, self.engine, _sample(parsed, first), probes=first)
            )
            self.passed(wait=False)  # stop early on a disagreement
            yield parsed

    def passed(self, wait: bool) -> None:
        """Raise `_EngineDisagrees` for the first finished check (with `wait`: any) that disagrees."""
        while self.pending and (wait or self.pending[0].done()):
            if problem := self.pending.popleft().result():
                raise _EngineDisagrees(problem, self.tok.reference().name)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class _Encoder:
    """One batch to checked ids, BOS/EOS-wrapped for text (a conversation's markers are added when
    it is written). Runs on a pool thread: numpy and the engines release the GIL, so the main
    thread only writes."""

    def __init__(self, job: _Job, engine: Engine) -> None:
        self.engine, self.tok, self.keys = engine, job.tok, job.keys
        self.bos, self.eos, self.dtype = job.bos, job.eos, job.dtype

    def __call__(self, parsed: Parsed) -> _Encoded:
        if parsed.chats is not None:
            if not parsed.chats:
                return {}
            texts = [p.text for c in parsed.chats for p in c if p.text is not None]
            empty = (np.zeros(0, np.uint32), np.zeros(0, np.int64))
            flat, lengths = self.engine.encode(texts) if texts else empty
            self.tok.check_no_special(flat)
            return {"chat": (flat, lengths)}
        encoded = {}
        for k in self.keys:
            if parsed.texts[k]:
                flat, lengths = self.engine.encode(parsed.texts[k])
                self.tok.check_no_special(flat)
                encoded[k] = _wrap(flat, lengths, self.bos, self.eos, self.dtype)
        return encoded


def _in_order(
    batches: Iterable[Parsed], encode: Callable[[Parsed], _Encoded], pool: ThreadPoolExecutor, ahead: int
) -> Iterator[tuple[Parsed, _Encoded]]:
    """Each batch with its encoding, in input order. `ahead` batches encode at once and one more
    waits, so no encoding thread idles while the caller writes."""
    pending: deque[tuple[Parsed, Future]] = deque()
    for parsed in batches:
        pending.append((parsed, pool.submit(encode, parsed)))
        if len(pending) > ahead:
            done, fut = pending.popleft()
            yield done, fut.result()
    while pending:
        done, fut = pending.popleft()
        yield done, fut.result()


class _Shards:
    """The output's shards: one per key, and for conversations `chat.roles` beside them (a role
    code per token); batches are appended in input order, the sums computed while writing."""

    def __init__(
        self, w: ArtifactWriter, keys: list[str], dtype: str, bos: int | None, eos: int | None, chat: bool
    ) -> None:
        self.w, self.keys, self.bos, self.eos = w, keys, bos, eos
        self.writers = {k: IndexedWriter(w.path(f"shards/{_safe_name(k)}"), dtype) for k in keys}
        self.roles = IndexedWriter(w.path("shards/chat.roles"), "uint8") if chat else None
        self.every = [*self.writers.values(), *([self.roles] if self.roles is not None else [])]

    def write(self, parsed: Parsed, encoded: _Encoded) -> tuple[int, int]:
        """Append one batch; (documents, tokens) it added."""
        ndocs = ntok = 0
        for k, (flat, lengths) in encoded.items():
            if parsed.chats is not None:
                ndocs, ntok = _assemble_chats(
                    parsed.chats, flat, lengths, self.bos, self.eos, self.writers[k], self.roles
                )
            else:
                self.writers[k].add(flat, lengths)
                ndocs, ntok = len(lengths), ntok + len(flat)
        return ndocs, ntok

    def close(self) -> None:
        """Finish every file and record its sums with the artifact (commit need not reread them)."""
        for wr in self.every:
            wr.close()
            self.w.record(f"shards/{wr.prefix.name}.bin", wr.bin_sha256)
            self.w.record(f"shards/{wr.prefix.name}.idx", wr.idx_sha256)

    def abort(self) -> None:
        for wr in self.every:
            wr.abort()

    @property
    def documents(self) -> int:
        return self.writers[self.keys[0]].documents

    def entries(self) -> list[mf.Shard]:
        """The manifest's shard entries."""
        sidecars = {"roles": "shards/chat.roles"} if self.roles is not None else {}
        return [
            mf.Shard(
                prefix=f"shards/{_safe_name(k)}",
                json_key=k,
                documents=self.writers[k].documents,
                tokens=self.writers[k].tokens,
                sidecars=sidecars,
            )
            for k in self.keys
        ]


def _manifest(job: _Job, tok_files: list[str], shards: list[mf.Shard], engine: Engine) -> mf.TokensManifest:
    opts, tok = job.opts, job.tok
    return mf.TokensManifest(
        **mf.new_header_fields("mega-tokenize", __version__),
        tokenizer=mf.TokenizerInfo(
            type=tok.type,
            files=tok_files,
            vocab_size=tok.vocab_size,
            fingerprint=job.settings["tokenizer"],
            base_vocab_size=tok.base_vocab_size,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            unk_id=tok.unk_id,
            added_special_tokens=dict(tok.added),
            stop_ids=tok.stop_ids,
        ),
        dtype=job.dtype,
        format=opts.format,
        append_eos=opts.append_eos,
        prepend_bos=opts.prepend_bos,
        chat_template=job.template,
        roles=dict(ROLE_CODES) if opts.format == "chat" else {},
        engine=engine.name,
        json_keys=job.keys if opts.format == "text" else [],
        on_error=opts.on_error,
        inputs=job.inputs,
        shards=shards,
        counts=mf.TokenCounts(
            documents=shards[0].documents,
            tokens=sum(s.tokens for s in shards),
            skipped_lines=job.skips.count,
            skipped_examples=job.skips.examples,
        ),
    )


def _sample(parsed: Parsed, first: bool) -> list[str]:
    """What the engine is checked on: documents spread evenly over the batch, up to 128 KB of the
    first batch and 32 KB of every later one (about 0.2% of the input at the default batch size)."""
    if parsed.chats is not None:
        texts = [p.text for c in parsed.chats for p in c if p.text]
    else:
        texts = [t for ts in parsed.texts.values() for t in ts]
    budget, picked = (128 if first else 32) << 10, []
    step = max(1, len(texts) // max(1, budget // 2048))  # ~2 KB documents: about budget/2KB of them
    for t in texts[::step]:
        if budget <= 0:
            break
        picked.append(t[:16384])
        budget -= len(picked[-1])
    return picked


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


def _assemble_chats(
    chats, flat: np.ndarray, lengths: np.ndarray, bos, eos, writer: IndexedWriter, roles_writer
) -> tuple[int, int]:
    """Conversations from their text pieces' ids (encoded in one engine call) and marker ids."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids_parts: list[np.ndarray] = []
    role_parts: list[np.ndarray] = []
    doc_lengths = np.empty(len(chats), dtype=np.int64)
    ti = 0
    for ci, chat in enumerate(chats):
        n = 0
        if bos is not None:
            ids_parts.append(np.array([bos], np.uint32))
            role_parts.append(np.zeros(1, np.uint8))
            n += 1
        for p in chat:
            if p.text is None:
                ids = np.array([p.token], np.uint32)
            else:
                ids = flat[offsets[ti] : offsets[ti + 1]]
                ti += 1
            ids_parts.append(ids)
            role_parts.append(np.full(len(ids), p.role, np.uint8))
            n += len(ids)
        if eos is not None:
            ids_parts.append(np.array([eos], np.uint32))
            role_parts.append(np.zeros(1, np.uint8))
            n += 1
        doc_lengths[ci] = n
    all_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.uint32)
    all_roles = np.concatenate(role_parts) if role_parts else np.zeros(0, np.uint8)
    writer.add(all_ids, doc_lengths)
    roles_writer.add(all_roles, doc_lengths)
    return len(chats), len(all_ids)
