"""Input files: globs and directories expanded, `.jsonl`, `.jsonl.zst` and `.jsonl.gz` streamed.

Decompression streams in bounded chunks (a 50 GB input never has to fit in memory). Lines come out
in batches with the 1-based line number of the first one, so every error can say `file:line`.
A truncated `.zst`/`.gz` is detected at its end and reported at the last line read.
"""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from megacore.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json.zst", ".json.gz", ".zst", ".gz", ".json")
_READ = 1 << 22  # 4 MiB of compressed or plain bytes per read


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
                raise UserError(f"no {', '.join(SUFFIXES[:3])} files in this directory", spec)
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
