"""Input files: globs and directories expanded, `.jsonl`, `.jsonl.zst`, `.jsonl.gz`, `.parquet`
and `.arrow` streamed.

Decompression streams in bounded chunks (a 50 GB input never has to fit in memory). Lines come out
in batches with the 1-based line number of the first one, so every error can say `file:line`.
A truncated `.zst`/`.gz` is detected at its end and reported at the last line read.

Parquet files (a Hub dataset's `data/train-00000-of-00002.parquet`) are read with pyarrow, one row
group at a time in record batches of about a megabyte, only the columns read: memory is at most
about one row group of those columns (a dictionary-encoded column chunk's dictionary is decoded
whole) plus the batches handed on, whatever the file's size. Their schemas are checked before
anything is read (`check_columns`, `preference_columns`): a file that is not Parquet, a missing
column or one of the wrong type is one line naming the file. Rows come out as `RowBatch`es of
Python values (the same `str` the jsonl path decodes), so the same parsers, encoders and writers
follow, and the shards are the ones the same rows as jsonl give. Arrow IPC stream files (those of
a `save_to_disk` dataset, hf_datasets.py) are read the same way a record batch at a time, and so are
the Arrow tables of a dataset `datasets` streams (`read_tables`).
"""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from megacore.errors import UserError

SUFFIXES = (
    ".jsonl", ".jsonl.zst", ".jsonl.gz", ".parquet", ".json.zst", ".json.gz", ".zst", ".gz", ".json",
)  # fmt: skip
_READ = 1 << 22  # 4 MiB of compressed or plain bytes per read
PARQUET_MAGIC = b"PAR1"
_PARQUET_READ = 1 << 20  # about this many bytes of the columns read per record batch (or slice of one)
_PARQUET_BUFFER = 1 << 20  # column chunks are read through a buffer this size, not whole


def _is_input(p: Path) -> bool:
    return p.is_file() and p.name.endswith(SUFFIXES)


def expand_inputs(specs: list[str]) -> list[Path]:
    """Files named by paths, globs or directories (searched recursively), sorted, each once."""
    out: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if _is_input(q))
            if not found:
                raise UserError(
                    f"no {', '.join(SUFFIXES[:3])} or {SUFFIXES[3]} files in this directory", spec
                )
            out += found
        elif p.is_file():
            out.append(p)
        elif glob.has_magic(spec):
            found = sorted(Path(q) for q in glob.glob(spec, recursive=True) if Path(q).is_file())
            if not found:
                raise UserError("the pattern matches no file", spec)
            out += found
        else:
            raise UserError("no such file or directory", spec)
    seen: set[str] = set()
    unique = []
    for p in out:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


class Truncated(Exception):
    """The compressed stream ended before its end marker."""


def _frames(
    f, new: Callable[[], object], errors: type[Exception], name: str, truncated: str
) -> Iterator[bytes]:
    """Decompressed chunks of a stream of concatenated frames (zstd frames, gzip members): what was
    decoded before a truncation or corruption is still handed out, then `Truncated` is raised."""
    obj, pending = new(), False
    while raw := f.read(_READ):
        while raw:
            try:
                out = obj.decompress(raw)
            except errors as e:
                raise Truncated(f"corrupt {name} data ({e})") from None
            pending = True
            if out:
                yield out
            if obj.eof:  # a frame ended; the rest is the next frame (pzstd, concatenated files)
                raw, obj, pending = obj.unused_data, new(), False
            else:
                raw = b""
    if pending:
        raise Truncated(truncated)


def _zstd_chunks(f) -> Iterator[bytes]:
    import zstandard

    d = zstandard.ZstdDecompressor()
    yield from _frames(
        f, d.decompressobj, zstandard.ZstdError, "zstd", "the .zst file is truncated (it ends inside a frame)"
    )


def _gzip_chunks(f) -> Iterator[bytes]:
    # zlib directly (not GzipFile), so that a truncated member still yields what it decoded.
    yield from _frames(
        f,
        lambda: zlib.decompressobj(wbits=31),
        zlib.error,
        "gzip",
        "the .gz file is truncated (it ends before the end-of-stream marker)",
    )


def _chunks(path: Path, f) -> Iterator[bytes]:
    magic = f.read(4)
    f.seek(0)
    # By content, not by name: a .jsonl.zst renamed .jsonl still reads.
    if magic == b"\x28\xb5\x2f\xfd":
        yield from _zstd_chunks(f)
    elif magic[:2] == b"\x1f\x8b":
        yield from _gzip_chunks(f)
    else:
        while raw := f.read(_READ):
            yield raw


@dataclass
class LineBatch:
    """Complete lines of one file: `data` is them joined by newlines (no trailing one)."""

    path: Path
    first_line: int  # 1-based number of the first line
    data: bytes | memoryview  # a view into the read buffer: batches are not copied again
    nlines: int
    nbytes: int  # decompressed bytes these lines came from
    truncated: str | None = None  # set on the last batch of a truncated file

    def lines(self) -> list[bytes]:
        return bytes(self.data).split(b"\n") if self.nlines else []


def _batch(path: Path, line_no: int, data: bytes, cut: int, nbytes: int, truncated: str | None = None):
    """The lines of data[:cut] (cut < 0: none)."""
    if cut < 0:
        return LineBatch(path, line_no, b"", 0, nbytes, truncated)
    return LineBatch(path, line_no, memoryview(data)[:cut], data.count(b"\n", 0, cut) + 1, nbytes, truncated)


def read_lines(path: Path, batch_bytes: int | Callable[[int], int] = 8 << 20) -> Iterator[LineBatch]:
    """Batches of complete lines from one input file, about `batch_bytes` each: a size, or a
    function of the (estimated) decompressed bytes left in the file giving the next batch's size."""
    line_no = 1
    rest = b""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; the generator may be abandoned early
        file_size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise UserError(f"cannot read ({e.strerror})", str(path)) from None

    def next_size() -> int:
        if not callable(batch_bytes):
            return batch_bytes
        raw = f.tell()  # (decompressed bytes so far) / (raw bytes so far): the compression ratio
        left = (file_size - raw) * produced // raw if raw and produced else file_size - raw
        return batch_bytes(left + len(rest))

    try:
        buf: list[bytes] = []
        size = produced = 0
        target = next_size()
        try:
            for chunk in _chunks(path, f):
                buf.append(chunk)
                size += len(chunk)
                produced += len(chunk)
                if size >= target:
                    data = b"".join([rest, *buf])
                    cut = data.rfind(b"\n")
                    buf, size = [], 0
                    if cut < 0:
                        rest = data
                        continue
                    batch = _batch(path, line_no, data, cut, cut + 1)
                    line_no += batch.nlines
                    rest = data[cut + 1 :]
                    target = next_size()
                    yield batch
        except Truncated as e:
            # What was read is complete lines up to the last newline, then the cut-off line.
            data = b"".join([rest, *buf])
            cut = data.rfind(b"\n")
            yield _batch(path, line_no, data, cut, len(data), truncated=str(e))
            return
        data = b"".join([rest, *buf])
        if data:
            cut = len(data) - 1 if data.endswith(b"\n") else len(data)
            yield _batch(path, line_no, data, cut, len(data))
    finally:
        f.close()


# --- Parquet and Arrow ---------------------------------------------------------------------------


def is_parquet(path: Path) -> bool:
    """By name (`.parquet`) or by content (the magic bytes), as compression is told by content."""
    if path.name.endswith(".parquet"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def is_arrow(path: Path) -> bool:
    """An Arrow IPC stream file, as `datasets` writes them (`save_to_disk`'s data-0000N-of-0000M.arrow)."""
    return path.name.endswith(".arrow")


def is_columnar(path: Path) -> bool:
    """Read as rows of columns (Parquet, Arrow), not as lines."""
    return is_arrow(path) or is_parquet(path)


@dataclass
class RowBatch:
    """Rows of one columnar source: per column read, its values as Python objects (None for null)."""

    source: str  # the file, or a dataset's split (`repo (subset a, split train)`)
    first_row: int  # 1-based number of the first row in its source
    columns: dict[str, list]
    nrows: int
    nbytes: int  # Arrow bytes of these columns

    def where(self, row: int) -> str:
        return f"{self.source}: row {row}"


def _why(e: BaseException) -> str:
    """An exception's message as one line."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _open_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, pre_buffer=False, buffer_size=_PARQUET_BUFFER)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"not a Parquet file, or a damaged one ({_why(e)})", str(path)) from None


def _open_arrow(path: Path):
    """A reader of an Arrow IPC stream file, a record batch at a time (read, not memory-mapped: the
    pages of a mapped file would count as the process's memory as they are read)."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.OSFile(str(path)))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"not an Arrow stream file, or a damaged one ({_why(e)})", str(path)) from None


def file_schema(path: Path):
    """The Arrow schema of a Parquet or Arrow file, from its footer or first message only."""
    if is_arrow(path):
        reader = _open_arrow(path)
        try:
            return reader.schema
        finally:
            reader.close()
    with _open_parquet(path) as pf:
        return pf.schema_arrow


def _is_text(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t) -> bool:
    """A list of structs with string `role` and `content` (other fields are ignored, as in jsonl)."""
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(k in fields and _is_text(fields[k]) for k in ("role", "content"))


def _names(schema) -> str:
    """The first column names of a schema, for a message."""
    return ", ".join(f'"{n}"' for n in schema.names[:12]) + (", ..." if len(schema.names) > 12 else "")


def check_columns(schema, columns: list[str], chat: bool, where: str) -> None:
    """`schema` (of a file or a dataset, named by `where`) has `columns` of the right type: strings,
    or for `chat` a list of {role, content} structs."""
    for c in columns:
        if c not in schema.names:
            what = "messages" if chat else "text"
            raise UserError(
                f'no column "{c}" (it has {_names(schema)}; choose the {what} column with --json-key)', where
            )
        t = schema.field(c).type
        if chat and not _is_messages(t):
            raise UserError(
                f'column "{c}" is {t}, expected a list of {{role, content}} structs of strings', where
            )
        if not chat and not _is_text(t):
            raise UserError(f'column "{c}" is {t}, expected strings', where)


def preference_columns(schema, where: str) -> list[str]:
    """What a preference pair is read from in `schema` (of a file or a dataset), checked: `chosen`
    and `rejected`, and `prompt` where there is one (conversations may leave it out), all strings or
    all lists of {role, content} structs."""
    columns = [c for c in ("prompt", "chosen", "rejected") if c in schema.names]
    for c in ("chosen", "rejected"):
        if c not in columns:
            raise UserError(
                f'no column "{c}" (it has {_names(schema)}; preference rows need chosen and rejected)', where
            )
    types = {c: schema.field(c).type for c in columns}
    if all(_is_messages(t) for t in types.values()):
        return columns
    if all(_is_text(t) for t in types.values()):
        if "prompt" not in columns:
            raise UserError(
                f'no column "prompt" (it has {_names(schema)}; only conversations may leave it out)', where
            )
        return columns
    said = ", ".join(f'"{c}" is {t}' for c, t in types.items())
    raise UserError(
        f"columns {said}: expected all strings, or all lists of {{role, content}} structs of strings", where
    )


def prompt_columns(schema, where: str) -> list[str]:
    """What a prompt row is read from in `schema`: every column, `prompt` among them, strings or a
    list of {role, content} structs (the others, any type, are kept for the reward functions)."""
    if "prompt" not in schema.names:
        raise UserError(f'no column "prompt" (it has {_names(schema)}; prompt rows need one)', where)
    t = schema.field("prompt").type
    if not (_is_text(t) or _is_messages(t)):
        raise UserError(
            f'column "prompt" is {t}, expected strings or lists of {{role, content}} structs of strings',
            where,
        )
    return list(schema.names)


def _column_bytes(rg, columns: list[str]) -> int:
    """Uncompressed bytes of `columns` (and their nested leaves) in one row group."""
    total = 0
    for j in range(rg.num_columns):
        col = rg.column(j)
        if col.path_in_schema.split(".")[0] in columns or col.path_in_schema in columns:
            total += col.total_uncompressed_size
    return total or rg.total_byte_size


def _converted(batches: Iterable, columns: list[str]) -> Iterator[tuple[dict[str, list], int, int]]:
    """Record batches (or tables) as Python lists per column, with their rows and Arrow bytes, in
    slices of about _PARQUET_READ bytes: a record batch of a `save_to_disk` file or a table of
    `datasets` can hold 1000 long documents (tens of megabytes), which would otherwise become one
    batch of documents that large, several of them in flight at once."""
    import pyarrow as pa

    pool = pa.default_memory_pool()
    for rb in batches:
        per = max(1, int(rb.num_rows * _PARQUET_READ / max(1, rb.nbytes)))
        for start in range(0, rb.num_rows, per):
            part = rb.slice(start, per)
            values, n, size = {c: part.column(c).to_pylist() for c in columns}, part.num_rows, part.nbytes
            del part
            yield values, n, size
        del rb
        # Arrow's allocator keeps freed pages for itself; handed back, the Python strings made next
        # reuse them (measured: ~25 MB less peak RSS on 200 MB of Parquet, <1% more CPU).
        pool.release_unused()


def _record_batches(pf, path: Path, columns: list[str], sizes: list[int]) -> Iterator:
    """The file's record batches, a row group at a time, about _PARQUET_READ bytes each: per batch
    its columns as Python lists, its rows, its Arrow bytes, and its share of the footer's (encoded)
    size of the columns."""
    import pyarrow as pa

    meta = pf.metadata
    ratio = 1.0  # Arrow bytes per encoded byte so far (a dictionary can make it far above 1)
    for i in range(meta.num_row_groups):
        rows = meta.row_group(i).num_rows
        per_read = max(1, min(rows, int(rows * _PARQUET_READ / max(1.0, sizes[i] * ratio))))
        got = 0
        batches = pf.iter_batches(per_read, row_groups=[i], columns=columns, use_threads=False)
        try:
            for values, n, size in _converted(batches, columns):
                got += size
                yield values, n, size, sizes[i] * n / rows
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise UserError(f"row group {i} cannot be read ({_why(e)})", str(path)) from None
        ratio = got / max(1, sizes[i])


def gather_rows(
    source: str, chunks: Iterable[tuple[dict[str, list], int, int, float]], columns: list[str],
    next_size: Callable[[float, float], int],
) -> Iterator[RowBatch]:  # fmt: skip
    """Chunks of rows (values per column, rows, Arrow bytes, share of the source's encoded size)
    gathered into RowBatches of about `next_size(encoded, read)` Arrow bytes each, given the
    encoded share and the Arrow bytes of the batches handed on so far."""
    encoded = read = 0.0
    first, target = 1, next_size(encoded, read)
    pending: dict[str, list] = {c: [] for c in columns}
    nrows = nbytes = 0
    share = 0.0
    for values, n, size, part in chunks:
        for c in columns:
            pending[c] += values[c]
        nrows, nbytes, share = nrows + n, nbytes + size, share + part
        if nbytes >= target:
            yield RowBatch(source, first, pending, nrows, nbytes)
            encoded, read = encoded + share, read + nbytes
            first, target = first + nrows, next_size(encoded, read)
            pending, nrows, nbytes, share = {c: [] for c in columns}, 0, 0, 0.0
    if nrows:
        yield RowBatch(source, first, pending, nrows, nbytes)


def _sizer(batch_bytes: int | Callable[[int], int], total: float) -> Callable[[float, float], int]:
    """The next batch's size: a fixed one, or `batch_bytes` of the bytes left, estimated as for
    compressed jsonl: the encoded bytes left (of `total`) times the expansion so far."""

    def next_size(encoded: float, read: float) -> int:
        if not callable(batch_bytes):
            return batch_bytes
        left = total - encoded
        return batch_bytes(int(left * read / encoded) if encoded else int(left))

    return next_size


def read_parquet(
    path: Path, columns: list[str], batch_bytes: int | Callable[[int], int] = 8 << 20
) -> Iterator[RowBatch]:
    """Batches of rows of `columns` from one Parquet file, about `batch_bytes` (of Arrow data) each:
    a size, or a function of the (estimated) bytes left in the file giving the next batch's size."""
    with _open_parquet(path) as pf:
        meta = pf.metadata
        sizes = [_column_bytes(meta.row_group(i), columns) for i in range(meta.num_row_groups)]
        chunks = _record_batches(pf, path, columns, sizes)
        yield from gather_rows(str(path), chunks, columns, _sizer(batch_bytes, sum(sizes)))


def _stream_batches(reader, path: Path, columns: list[str]) -> Iterator:
    """An Arrow stream's record batches as chunks for `gather_rows` (its share: the batch's bytes)."""
    import pyarrow as pa

    try:
        for values, n, size in _converted((rb.select(columns) for rb in reader), columns):
            yield values, n, size, size
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot be read ({_why(e)})", str(path)) from None


def read_arrow(
    path: Path, columns: list[str], batch_bytes: int | Callable[[int], int] = 8 << 20
) -> Iterator[RowBatch]:
    """Batches of rows of `columns` from one Arrow IPC stream file (a `save_to_disk` shard), a
    record batch at a time, about `batch_bytes` each (as `read_parquet`)."""
    reader = _open_arrow(path)
    try:
        chunks = _stream_batches(reader, path, columns)
        yield from gather_rows(str(path), chunks, columns, _sizer(batch_bytes, path.stat().st_size))
    finally:
        reader.close()


def read_tables(
    source: str, tables: Iterable, columns: list[str], batch_bytes: int | Callable[[int], int]
) -> Iterator[RowBatch]:
    """Batches of rows of `columns` from Arrow tables of unknown number (a dataset streamed by
    `datasets`), about `batch_bytes` each (a function: of bytes left, unknown, so as for a large
    file)."""
    chunks = ((*chunk, 0.0) for chunk in _converted(tables, columns))
    yield from gather_rows(source, chunks, columns, _sizer(batch_bytes, float(1 << 62)))


def read_rows(path: Path, columns: list[str], batch_bytes: int | Callable[[int], int]) -> Iterator[RowBatch]:
    """A columnar file's rows (`is_columnar`), Arrow or Parquet."""
    return (read_arrow if is_arrow(path) else read_parquet)(path, columns, batch_bytes)
