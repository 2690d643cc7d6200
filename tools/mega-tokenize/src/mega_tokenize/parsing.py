"""The input as batches of documents: read (inputs.py), parsed, and every bad line reported.

A batch of jsonl lines is decoded in one call into typed records; only a batch with a problem is
parsed again line by line, to say which line and why. Parquet rows arrive as the columns' strings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from mega_tokenize.chat import ChatError, Segment, json_type, messages_of
from mega_tokenize.inputs import LineBatch, RowBatch, is_columnar, read_lines, read_rows
from megacore.errors import UserError

MAX_EXAMPLES = 10


class Skips:
    """Bad lines: raise (`--on-error fail`) or count them and keep the first few messages."""

    def __init__(self, mode: str) -> None:
        self.mode, self.count, self.examples = mode, 0, []

    def __call__(self, where: str, msg: str) -> None:
        if self.mode == "fail":
            raise UserError(f"{msg} (or pass --on-error skip to skip such lines)", where)
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {msg}")


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
    """One batch of documents: per json key their texts (text format), or rendered pieces (chat;
    preference: each pair's chosen then rejected document)."""

    texts: dict[str, list[str]]
    chats: list[list[Segment]] | None
    nbytes: int
    columns: list[dict] | None = None  # prompts: each document's row besides the prompt


class TextParser:
    def __init__(self, keys: list[str], skips: Skips) -> None:
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
                err = f"expected a JSON object, got {json_type(obj)}"
            if err is None:
                for k in self.keys:
                    if k not in obj:
                        err = f'missing key "{k}" (choose the key with --json-key)'
                    elif not isinstance(obj[k], str):
                        err = f'key "{k}" is {json_type(obj[k])}, expected a string'
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


class RecordParser:
    """Records to rendered documents, for the formats made of segments: a jsonl line's object or a
    Parquet row (`{column: value}`) through `documents` (`chat_documents`, a preference pair's
    two, a prompt); a ChatError it raises is that line's (row's) problem. With `columns`, what each
    record keeps besides its one document (a prompt's answer...)."""

    def __init__(
        self,
        documents: Callable[[object], list[list[Segment]]],
        skips: Skips,
        columns: Callable[[dict], dict] | None = None,
    ) -> None:
        self.documents, self.skips, self.columns = documents, skips, columns

    def __call__(self, b: LineBatch | RowBatch) -> Parsed:
        chats: list[list[Segment]] = []
        kept: list[dict] | None = [] if self.columns is not None else None
        for where, obj, err in _records(b):
            if err is None:
                try:
                    chats += self.documents(obj)
                    if kept is not None:  # one document a record (prompts)
                        kept.append(self.columns(obj))
                    continue
                except ChatError as e:
                    err = str(e)
            self.skips(where, err)
        return Parsed({}, chats, b.nbytes, kept)


def _records(b: LineBatch | RowBatch) -> Iterator[tuple[str, Any, str | None]]:
    """Each record of a batch with where it is, or what is wrong with its line."""
    if isinstance(b, RowBatch):
        for i in range(b.nrows):
            yield b.where(b.first_row + i), {c: v[i] for c, v in b.columns.items()}, None
        return
    for n, line in enumerate(b.lines(), start=b.first_line):
        if line.strip():  # blank lines are not records
            obj, err = _line_error(line)
            yield f"{b.path}:{n}", obj, err


def chat_documents(
    render: Callable[[list[tuple[str, str]]], list[Segment]], key: str = "messages"
) -> Callable[[object], list[list[Segment]]]:
    """Conversations: a record's `messages` (or Megatron-LLM's question/answer), or under another
    key (`--json-key`) just the messages; a Parquet row's messages column."""

    def documents(obj: object) -> list[list[Segment]]:
        if key != "messages" and isinstance(obj, dict):
            if key not in obj:
                raise ChatError(f'missing key "{key}" (choose the messages key with --json-key)')
            obj = {"messages": obj[key]}
        return [render(messages_of(obj))]

    return documents


MIN_BATCH = 4 << 20


def _ramp(max_bytes: int, parallel: int) -> Callable[[int, int], int]:
    """The next batch's size from the bytes left in its source and after it (see batch_sizes)."""
    lo = min(MIN_BATCH, max_bytes)
    made = 0

    def size(left_in_file: int, after: int) -> int:
        nonlocal made
        made += 1
        ramp = lo << min(made - 1, 16)
        return max(lo, min(max_bytes, ramp, (left_in_file + after) // (2 * parallel)))

    return size


def batch_sizes(files: list[Path], max_bytes: int, parallel: int) -> list[Callable[[int], int]]:
    """Per file, the next batch's size from the bytes left in it. An engine call starts with
    cold caches, so batches are large (up to `max_bytes`: measured ~20% less engine CPU at
    16 MB than at 4 MB), but the first ones ramp up from MIN_BATCH (encoding starts at once)
    and the last ones shrink with what is left (the threads finish together, no long tail)."""
    later = [0] * len(files)  # raw bytes of the files after each one
    for i in range(len(files) - 2, -1, -1):
        later[i] = later[i + 1] + files[i + 1].stat().st_size
    size = _ramp(max_bytes, parallel)
    return [lambda left, after=after: size(left, after) for after in later]


def stream_sizes(max_bytes: int, parallel: int) -> Callable[[int], int]:
    """As `batch_sizes`, for one stream of unknown length (a dataset read through `datasets`): the
    ramp up to `max_bytes`; its end is not known in advance, so no shrinking tail."""
    size = _ramp(max_bytes, parallel)
    return lambda left: size(left, 0)


def parsed_batches(
    files: list[Path],
    parse: Callable[[LineBatch | RowBatch], Parsed],
    skips: Skips,
    batch_bytes: int,
    parallel: int,
    columns: dict[Path, list[str]],
) -> Iterator[Parsed]:
    """Every file's batches, parsed, in input order (`columns`: what is read of each Parquet or
    Arrow file)."""
    for path, sizes in zip(files, batch_sizes(files, batch_bytes, parallel), strict=True):
        if is_columnar(path):
            for rows in read_rows(path, columns[path], sizes):
                yield parse(rows)
            continue
        for b in read_lines(path, sizes):
            yield parse(b)
            if b.truncated:
                where = f"{path}:{b.first_line + b.nlines}"
                skips(where, b.truncated)
