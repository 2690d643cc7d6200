"""Corpus files to a `tokens` artifact: read, parse, encode, write; one pass, bounded memory.

A reader thread streams and parses the input (decompression and JSON parsing in C), encoding
threads turn batches into checked, EOS/BOS-wrapped ids (the engine and numpy release the GIL;
`--workers` batches at once for gigatoken, whose calls each run on their thread), and the main
thread appends them to the shards, which hash and flush as they grow. Batches are written in input
order and a document's ids do not depend on its batch, so the shards are byte-identical for any
`--workers`.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
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
    Piece,
    TemplateRenderer,
    messages_of,
    render_chatml,
)
from mega_tokenize.inputs import LineBatch, expand_inputs, read_lines
from mega_tokenize.tokenizer import (
    Engine,
    Tokenizer,
    candidate_engine,
    load_tokenizer,
    set_threads,
    verify_engine,
)
from megacore.artifacts import manifest as mf
from megacore.artifacts.reader import open_artifact
from megacore.artifacts.writer import write_artifact
from megacore.data.indexed import IndexedWriter, token_dtype
from megacore.errors import UserError

MAX_EXAMPLES = 10


@dataclass
class Options:
    inputs: list[str]
    out: Path
    tokenizer: Path
    json_keys: list[str] = field(default_factory=lambda: ["text"])
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
    chats: list[list[Piece]] | None
    nbytes: int


class TextParser:
    def __init__(self, keys: list[str], skips: _Skips) -> None:
        self.keys, self.skips = keys, skips
        fields = [(f"k{i}", str) for i in range(len(keys))]
        doc = msgspec.defstruct("Doc", fields, rename={f"k{i}": k for i, k in enumerate(keys)})
        self.decoder = msgspec.json.Decoder(doc)
        self.getters = [(k, f"k{i}") for i, k in enumerate(keys)]

    def __call__(self, b: LineBatch) -> Parsed:
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


class ChatParser:
    def __init__(self, render: Callable[[list[tuple[str, str]]], list[Piece]], skips: _Skips) -> None:
        self.render, self.skips = render, skips

    def __call__(self, b: LineBatch) -> Parsed:
        chats = []
        for n, line in enumerate(b.lines(), start=b.first_line):
            if not line.strip():
                continue
            obj, err = _line_error(line)
            if err is None:
                try:
                    chats.append(self.render(messages_of(obj)))
                    continue
                except ChatError as e:
                    err = str(e)
            self.skips(f"{b.path}:{n}", err)
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
    parse: Callable[[LineBatch], Parsed],
    skips: _Skips,
    batch_bytes: int,
    parallel: int,
):
    for path, sizes in zip(files, _batch_sizes(files, batch_bytes, parallel), strict=True):
        for b in read_lines(path, sizes):
            yield parse(b)
            if b.truncated:
                where = f"{path}:{b.first_line + b.nlines}"
                skips(where, b.truncated)


class _Prefetch:
    """Run the reader/parser in a thread from construction on, `depth` batches ahead (so reading
    overlaps the engine's setup); its errors re-raise in the consumer. `close()` stops it."""

    _END = object()

    def __init__(self, it: Iterator[Parsed], depth: int = 2) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._it = it
        self._thread = threading.Thread(target=self._work, name="mega-tokenize-reader", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for item in self._it:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:
            self._put(e)

    def __iter__(self) -> Iterator[Parsed]:
        while True:
            item = self._q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()


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


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.5 and not final):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        print(
            f"\r{self.docs:,} docs  {self.tokens:,} tokens  {self.docs / dt:,.0f} docs/s  "
            f"{self.tokens / dt / 1e6:,.2f}M tok/s  {self.bytes / dt / 1e6:,.1f} MB/s   ",
            end="\n" if final else "",
            file=sys.stderr,
            flush=True,
        )


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key) or "text"


def _settings(opts: Options, tok: Tokenizer) -> dict:
    """What the ids depend on: a rerun with the same settings and inputs reuses the artifact."""
    return {
        "tokenizer": tok.fingerprint(),
        "format": opts.format,
        "json_keys": opts.json_keys if opts.format == "text" else [],
        "chat_template": opts.chat_template if opts.format == "chat" else None,
        "append_eos": opts.append_eos,
        "prepend_bos": opts.prepend_bos,
        "added": tok.added,
        "on_error": opts.on_error,
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

    The engine's ids are checked against the reference tokenizer on a sample while the run goes
    on (the check costs no wall time); if they differ, nothing is committed: `auto` starts over
    with the reference, a named engine is an error."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        return _tokenize(opts, log)
    except _EngineDisagrees as e:
        if opts.engine != "auto":
            raise UserError(f"{e}; use --engine {e.reference} or auto") from None
        log(f"mega-tokenize: WARNING: {e}; starting over with {e.reference} (slower, same ids)")
        return _tokenize(replace(opts, engine=e.reference), log)


def _tokenize(opts: Options, log: Callable[[str], None]) -> Result:
    t0 = time.perf_counter()
    if opts.workers < 1:
        raise UserError("--workers must be at least 1")
    if opts.format == "text" and not opts.json_keys:
        raise UserError("--json-key: at least one key is needed")
    if len(set(opts.json_keys)) != len(opts.json_keys):
        raise UserError("--json-key: the same key is given twice")
    set_threads(opts.workers)
    files = expand_inputs(opts.inputs)
    tok = load_tokenizer(opts.tokenizer, threads=opts.workers)
    if opts.add_special_tokens:
        tok.add_special_tokens(opts.add_special_tokens)
    if opts.append_eos and tok.eos_id is None:
        raise UserError("the tokenizer has no EOS token; pass --no-append-eos", str(opts.tokenizer))
    if opts.prepend_bos and tok.bos_id is None:
        raise UserError("the tokenizer has no BOS token; drop --prepend-bos", str(opts.tokenizer))
    settings = _settings(opts, tok)
    settings_sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    inputs = _inputs(files)

    out = Path(opts.out)
    if (out / mf.MANIFEST_NAME).is_file() and not opts.force:
        old = open_artifact(out, "tokens", verify="size")
        if old.settings_sha256 == settings_sha and old.inputs == inputs:
            return Result(old, reused=True, seconds=time.perf_counter() - t0)
        raise UserError(
            "already exists, made from other inputs or settings; pass --force to rebuild it", str(out)
        )

    skips = _Skips(opts.on_error)
    render = None
    template_name = None
    if opts.format == "chat":
        render, template_name = _chat_renderer(opts, tok)
        parse: Callable[[LineBatch], Parsed] = ChatParser(render, skips)
    else:
        parse = TextParser(opts.json_keys, skips)

    dtype = token_dtype(tok.vocab_size)
    bos = tok.bos_id if opts.prepend_bos else None
    eos = tok.eos_id if opts.append_eos else None
    keys = opts.json_keys if opts.format == "text" else ["chat"]
    names = [_safe_name(k) for k in keys]
    if len(set(names)) != len(names) or "chat.roles" in names:
        raise UserError(f"--json-key: keys {keys} would share an output file name; rename them")
    progress = Progress(opts.progress)
    total_bytes = 0

    with write_artifact(out, force=opts.force) as w:
        tok_files = []
        for f in tok.files:
            shutil.copyfile(f, w.path(f"tokenizer/{f.name}"))
            tok_files.append(f"tokenizer/{f.name}")
        writers = {k: IndexedWriter(w.path(f"shards/{_safe_name(k)}"), dtype) for k in keys}
        roles_writer = IndexedWriter(w.path("shards/chat.roles"), "uint8") if opts.format == "chat" else None
        engine: Engine | None = None

        def encode(parsed: Parsed) -> dict[str, tuple[np.ndarray, np.ndarray]]:
            """Encode one batch and check and wrap its ids (on a pool thread: numpy and the
            engines release the GIL, so the main thread only writes)."""
            if parsed.chats is not None:
                if not parsed.chats:
                    return {}
                texts = [p.text for c in parsed.chats for p in c if p.text is not None]
                empty = (np.zeros(0, np.uint32), np.zeros(0, np.int64))
                flat, lengths = engine.encode(texts) if texts else empty
                tok.check_no_special(flat)
                return {"chat": (flat, lengths)}
            out = {}
            for k in keys:
                if parsed.texts[k]:
                    flat, lengths = engine.encode(parsed.texts[k])
                    tok.check_no_special(flat)
                    out[k] = _wrap(flat, lengths, bos, eos, dtype)
            return out

        def finish(parsed: Parsed, encoded: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
            ndocs = ntok = 0
            for k, (flat, lengths) in encoded.items():
                if parsed.chats is not None:
                    ndocs, ntok = _assemble_chats(
                        parsed.chats, flat, lengths, bos, eos, writers[k], roles_writer
                    )
                else:
                    writers[k].add(flat, lengths)
                    ndocs, ntok = len(lengths), ntok + len(flat)
            progress.update(ndocs, ntok, parsed.nbytes)

        # `engine.concurrency` batches encode at once and one more waits, so no encoding thread
        # idles while the main thread writes; results are written strictly in input order. The
        # engine check runs on its own thread, off the critical path.
        pool: ThreadPoolExecutor | None = None
        checker: ThreadPoolExecutor | None = None
        pending: deque[tuple[Parsed, Future]] = deque()
        check: Future | None = None

        def verified() -> None:
            if check is not None and (problem := check.result()):
                raise _EngineDisagrees(problem, tok.reference().name)

        # Engines run max(2, workers) batches at once (see Engine.concurrency).
        batches = _Prefetch(_batches(files, parse, skips, opts.batch_bytes, max(2, opts.workers)))
        try:
            # Built while the reader parses the first batch.
            engine = candidate_engine(tok, opts.engine, log)
            depth = engine.concurrency + 1
            pool = ThreadPoolExecutor(engine.concurrency, thread_name_prefix="mega-tokenize-encode")
            checker = ThreadPoolExecutor(1, thread_name_prefix="mega-tokenize-check")
            for parsed in batches:
                if check is None:
                    check = checker.submit(verify_engine, tok, engine, _sample(parsed))
                elif check.done():
                    verified()  # stop early on a disagreement
                total_bytes += parsed.nbytes
                pending.append((parsed, pool.submit(encode, parsed)))
                if len(pending) >= depth:
                    done, fut = pending.popleft()
                    finish(done, fut.result())
            while pending:
                done, fut = pending.popleft()
                finish(done, fut.result())
            verified()  # before anything is committed
            for wr in [*writers.values(), *([roles_writer] if roles_writer else [])]:
                wr.close()
                w.record(f"shards/{wr.prefix.name}.bin", wr.bin_sha256)
                w.record(f"shards/{wr.prefix.name}.idx", wr.idx_sha256)
        except BaseException:
            batches.close()
            for ex in (pool, checker):
                if ex is not None:
                    ex.shutdown(wait=True, cancel_futures=True)
            for wr in [*writers.values(), *([roles_writer] if roles_writer else [])]:
                wr.abort()
            raise
        for ex in (pool, checker):
            if ex is not None:
                ex.shutdown()
        progress.update(0, 0, 0, final=True)
        if writers[keys[0]].documents == 0:
            raise UserError(
                f"no documents in the input ({skips.count} lines skipped)", ", ".join(opts.inputs)
            )
        shards = [
            mf.Shard(
                prefix=f"shards/{_safe_name(k)}",
                json_key=k,
                documents=writers[k].documents,
                tokens=writers[k].tokens,
                sidecars={"roles": "shards/chat.roles"} if opts.format == "chat" else {},
            )
            for k in keys
        ]
        first = shards[0]
        manifest = mf.TokensManifest(
            **mf.new_header_fields("mega-tokenize", __version__),
            tokenizer=mf.TokenizerInfo(
                type=tok.type,
                files=tok_files,
                vocab_size=tok.vocab_size,
                fingerprint=settings["tokenizer"],
                base_vocab_size=tok.base_vocab_size,
                bos_id=tok.bos_id,
                eos_id=tok.eos_id,
                pad_id=tok.pad_id,
                unk_id=tok.unk_id,
                added_special_tokens=dict(tok.added),
            ),
            dtype=dtype,
            format=opts.format,
            append_eos=opts.append_eos,
            prepend_bos=opts.prepend_bos,
            chat_template=template_name,
            roles=dict(ROLE_CODES) if opts.format == "chat" else {},
            engine=engine.name if engine else tok.reference().name,
            json_keys=keys if opts.format == "text" else [],
            on_error=opts.on_error,
            inputs=inputs,
            settings_sha256=settings_sha,
            shards=shards,
            counts=mf.TokenCounts(
                documents=first.documents,
                tokens=sum(s.tokens for s in shards),
                skipped_lines=skips.count,
                skipped_examples=skips.examples,
            ),
        )
        manifest = w.commit(manifest)
    return Result(manifest, reused=False, seconds=time.perf_counter() - t0, input_bytes=total_bytes)


def _sample(parsed: Parsed) -> list[str]:
    """What the engine is checked on: up to 128 KB of the first batch's real documents."""
    if parsed.chats is not None:
        texts = [p.text for c in parsed.chats[:200] for p in c if p.text]
    else:
        texts = [t for ts in parsed.texts.values() for t in ts[:500]]
    budget, picked = 128 << 10, []
    for t in texts:
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
