"""Any tensor/pipeline layout to any other, offline, streaming.

Each tensor is read once, in row blocks of at most `chunk_bytes`, from whatever pieces the source
has (TensorReader reads only the bytes a block needs), and every tensor-parallel rank's part of
the block is appended to that rank's file (SafetensorsStreamWriter, headers declared up front).
Peak memory is a few blocks, whatever the model size; the source files are reopened per block so
their memory maps never accumulate resident pages.
"""

from __future__ import annotations

import itertools
import math
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megacore.artifacts import (
    CheckpointManifest,
    Piece,
    SafetensorsStreamWriter,
    TensorReader,
    new_header_fields,
    open_artifact,
    parent_of,
    piece_entry,
    write_artifact,
)
from megacore.artifacts.layout import TORCH_DTYPES
from megacore.artifacts.manifest import Layout
from megacore.artifacts.reader import confined_path, read_manifest_bytes
from megacore.errors import UserError
from megacore.parallel.plan import TensorPlace, check_tp, place, split_optim_name, stage_layers, stage_of

DEFAULT_CHUNK_BYTES = 64 << 20
QUEUED_BLOCKS = 4


class _BackgroundWrites:
    """Writes blocks on one thread per output file, in order per file, while the next blocks are
    read: file writes and sha256 release the GIL, so reading, hashing and the disk overlap. The
    queues are bounded, so memory stays at a few blocks."""

    def __init__(self) -> None:
        self._lanes: dict[int, tuple[queue.Queue, threading.Thread]] = {}
        self._error: BaseException | None = None

    def _run(self, q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            if self._error is None:
                try:
                    item[0].write(item[1], item[2])
                except BaseException as e:
                    self._error = e

    def write(self, writer: SafetensorsStreamWriter, key: str, tensor) -> None:
        if self._error is not None:
            raise self._error
        lane = self._lanes.get(id(writer))
        if lane is None:
            q: queue.Queue = queue.Queue(maxsize=QUEUED_BLOCKS)
            lane = (q, threading.Thread(target=self._run, args=(q,), daemon=True))
            lane[1].start()
            self._lanes[id(writer)] = lane
        lane[0].put((writer, key, tensor))

    def stop(self) -> None:
        self._error = self._error or RuntimeError("stopped")
        self._join()

    def _join(self) -> None:
        for q, _ in self._lanes.values():
            q.put(None)
        for _, thread in self._lanes.values():
            thread.join()
        self._lanes.clear()

    def drain(self) -> None:
        """Wait until every queued block is written; re-raise a write error."""
        self._join()
        if self._error is not None:
            raise self._error


@dataclass
class ShardResult:
    out: str
    tp: int
    pp: int
    stage_layers: list[list[int]]
    reused: bool = False
    tensors: int = 0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def file_name(stage: int, tp_rank: int) -> str:
    return f"model-pp{stage:02d}-tp{tp_rank:02d}.safetensors"


def _order_key(name: str, p: TensorPlace) -> tuple:
    kind, param = split_optim_name(name)
    rank = {"first": 0, "layer": 1, "last": 2}[p.where]
    return (kind is not None, kind or "", rank, p.layer if p.layer is not None else 0, param)


def _tp_box(shape: Sequence[int], dim: int | None, tp: int, rank: int) -> tuple[list[int], list[int]]:
    off, shp = [0] * len(shape), list(shape)
    if dim is not None:
        size = shape[dim] // tp
        off[dim], shp[dim] = rank * size, size
    return off, shp


def _same_output(out: Path, src: Path, tp: int, pp: int, layers: list[list[int]]) -> bool:
    """An existing complete output made from this very source with this layout."""
    try:
        existing = open_artifact(out, "checkpoint", verify="size")
    except UserError:
        return False
    want = parent_of(src).manifest_sha256
    return (
        [p.manifest_sha256 for p in existing.parents] == [want]
        and existing.layout.tp == tp
        and existing.layout.pp == pp
        and existing.layout.stage_layers == layers
    )


def reshard(
    src: Path,
    out: Path,
    tp: int,
    pp: int,
    pp_layers: Sequence[int] | None = None,
    *,
    force: bool = False,
    verify: str = "size",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    producer: tuple[str, str] = ("mega-shard", "0.0.0"),
    log: Callable[[str], None] | None = None,
) -> ShardResult:
    """Write checkpoint `src` to `out` with tensor parallel `tp` and `pp` pipeline stages."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    manifest = open_artifact(src, "checkpoint", verify=verify)
    cfg = manifest.config
    # Every check before anything is written.
    check_tp(cfg, tp, "--tp")
    layers = stage_layers(cfg.num_layers, pp, pp_layers, "--pp-layers" if pp_layers else "--pp")
    if out.resolve() == read_manifest_bytes(src)[0].resolve():
        raise UserError("the output is the input checkpoint; choose another directory", str(out))
    places: dict[str, TensorPlace] = {}
    for name, entry in manifest.tensors.items():
        p = place(name, cfg, tp)
        if p.tp_dim is not None and (len(entry.shape) <= p.tp_dim or entry.shape[p.tp_dim] % tp):
            raise UserError(
                f"tensor {name!r} shape {entry.shape} does not split into {tp} along dim {p.tp_dim}", "--tp"
            )
        places[name] = p
    result = ShardResult(out=str(out), tp=tp, pp=pp, stage_layers=layers)
    if out.exists() and not force and _same_output(out, src, tp, pp, layers):
        result.reused = True
        result.tensors = len(manifest.tensors)
        log(
            f"mega-shard: {out} already holds this checkpoint at tp {tp} pp {pp}; reusing it (--force rebuilds)"
        )
        result.seconds = time.perf_counter() - t0
        return result

    src_root = read_manifest_bytes(src)[0]
    names = sorted(manifest.tensors, key=lambda n: _order_key(n, places[n]))
    by_stage: list[list[str]] = [[] for _ in range(pp)]
    for n in names:
        by_stage[stage_of(places[n], layers)].append(n)

    pieces: dict[str, list[Piece]] = {n: [] for n in names}
    reader = TensorReader(src_root)
    with write_artifact(out, force=force) as w:
        for s, stage_names in enumerate(by_stage):
            writers = []
            for t in range(tp):
                decl = []
                for n in stage_names:
                    e, p = manifest.tensors[n], places[n]
                    if p.tp_dim is None and t:
                        continue  # replicated tensors are stored once, with tp rank 0
                    off, shp = _tp_box(e.shape, p.tp_dim, tp, t)
                    decl.append((n, e.dtype, shp))
                    pieces[n].append(Piece(file=file_name(s, t), key=n, offset=off, shape=shp))
                writers.append(SafetensorsStreamWriter(w.path(file_name(s, t)), decl))
            bg = _BackgroundWrites()
            try:
                for n in stage_names:
                    _copy_tensor(
                        reader, n, manifest.tensors[n], places[n].tp_dim, tp, writers, chunk_bytes, bg
                    )
                bg.drain()
            except BaseException as e:
                bg.stop()
                for wr in writers:
                    wr.__exit__(type(e), e, None)  # closes the file without finishing it
                raise
            for t, wr in enumerate(writers):
                sha = wr.close()
                w.record(file_name(s, t), sha, wr.size)
                result.bytes_written += wr.size
                result.files.append(file_name(s, t))
            log(f"mega-shard: stage {s + 1}/{pp} written ({len(stage_names)} tensors, {tp} files)")
        extra = list(manifest.tokenizer_files)
        if manifest.training is not None:
            extra += manifest.training.rng_files
        for rel in extra:
            shutil.copyfile(confined_path(src_root, rel, str(src_root)), w.path(rel))
        new = CheckpointManifest(
            **new_header_fields(*producer),
            parents=[parent_of(src)],
            config=cfg,
            dtype=manifest.dtype,
            layout=Layout(tp=tp, pp=pp, dp=1, stage_layers=layers),
            tensors={
                n: piece_entry(manifest.tensors[n].shape, manifest.tensors[n].dtype, pieces[n]) for n in names
            },
            tokenizer_files=list(manifest.tokenizer_files),
            training=manifest.training,
        )
        w.commit(new)
    result.tensors = len(names)
    result.seconds = time.perf_counter() - t0
    return result


def _copy_tensor(
    reader: TensorReader,
    name: str,
    entry,
    dim: int | None,
    tp: int,
    writers,
    chunk_bytes: int,
    bg: _BackgroundWrites,
) -> None:
    """Stream one tensor in row blocks, appending each tp rank's part to its file."""
    shape = list(entry.shape)
    if not shape:
        bg.write(writers[0], name, reader.read(name, entry))
        reader.close()
        return
    itemsize = TORCH_DTYPES[entry.dtype].itemsize
    row_bytes = max(1, math.prod(shape[1:]) * itemsize)
    rows = max(1, chunk_bytes // row_bytes)
    part = shape[dim] // tp if dim is not None else 0
    # Blocks never straddle a source piece's rows (or a target rank's): a block then usually comes
    # from one piece and is read with a single copy.
    cuts = {0, shape[0]}
    for p in entry.pieces:
        cuts.update((p.offset[0], p.offset[0] + p.shape[0]))
    if dim == 0:
        cuts.update(t * part for t in range(tp))
    cuts = sorted(cuts)
    blocks = [(r0, min(rows, b - r0)) for a, b in itertools.pairwise(cuts) for r0 in range(a, b, rows)]
    for r0, n in blocks:
        block = reader.read(name, entry, ((r0, *[0] * (len(shape) - 1)), (n, *shape[1:])))
        reader.close()  # drop the memory maps: their touched pages would count as resident
        if dim is None:
            bg.write(writers[0], name, block)
        elif dim == 0:
            for t in range(tp):
                lo, hi = max(r0, t * part), min(r0 + n, (t + 1) * part)
                if hi > lo:
                    bg.write(writers[t], name, block[lo - r0 : hi - r0])
        else:
            for t in range(tp):
                # A strided view: the writer's thread makes it contiguous, off the reading thread.
                bg.write(writers[t], name, block.narrow(dim, t * part, part))
        del block
