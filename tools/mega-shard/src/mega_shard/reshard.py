"""Any tensor/pipeline layout to any other, offline, streaming.

Each tensor is read once, in row blocks of at most `chunk_bytes`, from whatever pieces the source
has (`CheckpointReader` reads only the bytes a block needs), and every tensor-parallel rank's part
of the block (`layout.tp_box`) is appended to that rank's file, on a background writer per file so
that reading, hashing and the disk overlap. Peak memory is a few blocks, whatever the model size;
the source files are unmapped after every block so their pages never accumulate as resident. The
source files are hashed while read and confirmed at the end of each stage, before it is reported
written and before the commit: a damaged file leaves no output.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megacore.artifacts import TORCH_DTYPES, parent_of
from megacore.artifacts.manifest import Layout, TensorEntry
from megacore.artifacts.output import recipe_sha256, reusable, write_artifact
from megacore.background import Background
from megacore.checkpoint import CheckpointReader, CheckpointWriter, shard_file
from megacore.errors import UserError
from megacore.parallel.layout import (
    TensorPlace,
    check_tp,
    place,
    split_optim_name,
    stage_layers,
    stage_of,
    tp_box,
)
from megacore.progress import Progress

DEFAULT_CHUNK_BYTES = 64 << 20
QUEUED_BLOCKS = 4


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


def _order_key(name: str, p: TensorPlace) -> tuple:
    kind, param = split_optim_name(name)
    rank = {"first": 0, "layer": 1, "last": 2}[p.where]
    return (kind is not None, kind or "", rank, p.layer if p.layer is not None else 0, param)


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
    progress: bool | None = None,
) -> ShardResult:
    """Write checkpoint `src` to `out` with tensor parallel `tp` and `pp` pipeline stages."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    with CheckpointReader(src, verify=verify) as ckpt:
        manifest, cfg = ckpt.manifest, ckpt.config
        # Every check before anything is written.
        check_tp(cfg, tp, "--tp")
        layers = stage_layers(cfg.num_layers, pp, pp_layers, "--pp-layers" if pp_layers else "--pp")
        places = {name: place(name, cfg, tp) for name in manifest.tensors}
        for name, e in manifest.tensors.items():
            dim = places[name].tp_dim
            if dim is not None and (len(e.shape) <= dim or e.shape[dim] % tp):
                raise UserError(
                    f"tensor {name!r} shape {e.shape} does not split into {tp} along dim {dim}", "--tp"
                )
        parent = parent_of(src)
        result = ShardResult(out=str(out), tp=tp, pp=pp, stage_layers=layers)
        recipe = recipe_sha256(checkpoint=parent.manifest_sha256, tp=tp, pp=pp, stage_layers=layers)
        if not force and reusable(out, "checkpoint", recipe) is not None:
            log(
                f"mega-shard: {out} already holds this checkpoint at tp {tp} pp {pp}; reusing it (--force rebuilds)"
            )
            result.reused, result.tensors = True, len(manifest.tensors)
            result.seconds = time.perf_counter() - t0
            return result

        names = sorted(manifest.tensors, key=lambda n: _order_key(n, places[n]))
        by_stage: list[list[str]] = [[] for _ in range(pp)]
        for n in names:
            by_stage[stage_of(places[n], layers)].append(n)
        total = sum(math.prod(e.shape) * TORCH_DTYPES[e.dtype].itemsize for e in manifest.tensors.values())
        shown = Progress("mega-shard", "tensors", total=len(names), total_bytes=total, enabled=progress)
        with write_artifact(out, "checkpoint", inputs=[src], force=force, recipe=recipe) as w:
            cw = CheckpointWriter(w)
            for s, stage_names in enumerate(by_stage):
                _write_stage(ckpt, cw, s, stage_names, places, tp, chunk_bytes, shown)
                # The source's sums, hashed meanwhile, before a stage is said to be written: a
                # damaged file is the one line of output, and leaves no output behind.
                ckpt.confirm()
                log(f"mega-shard: stage {s + 1}/{pp} written ({len(stage_names)} tensors, {tp} files)")
            extra = list(manifest.tokenizer_files) + (
                manifest.training.rng_files if manifest.training else []
            )
            for rel in extra:
                cw.add_file(ckpt.root / rel, rel)
            tokenizer = cw.add_tokenizer(ckpt.root, manifest.tokenizer) if manifest.tokenizer else None
            cw.commit(
                config=cfg,
                dtype=manifest.dtype,
                layout=Layout(tp=tp, pp=pp, dp=1, stage_layers=layers),
                producer=producer,
                parents=[parent],
                tokenizer_files=manifest.tokenizer_files,
                tokenizer=tokenizer,
                training=manifest.training,
                license=manifest.license,
                order=names,
            )
        shown.done()
    result.tensors, result.files, result.bytes_written = len(names), cw.files, cw.bytes_written
    result.seconds = time.perf_counter() - t0
    return result


def _write_stage(
    ckpt: CheckpointReader,
    cw: CheckpointWriter,
    stage: int,
    names: list[str],
    places: dict[str, TensorPlace],
    tp: int,
    chunk_bytes: int,
    shown: Progress,
) -> None:
    """The tp files of one pipeline stage; replicated tensors are stored once, with tp rank 0."""
    writers, lanes = [], []
    for t in range(tp):
        slices = []
        for n in names:
            e, p = ckpt.manifest.tensors[n], places[n]
            if p.tp_dim is None and t:
                continue
            slices.append((n, e.shape, e.dtype, tp_box(p, e.shape, tp, t)))
        writers.append(cw.open_file(shard_file(stage, t), slices))
        lanes.append(Background.sink(lambda item, sw=writers[-1]: sw.write(*item), depth=QUEUED_BLOCKS))
    try:
        for n in names:
            e = ckpt.manifest.tensors[n]
            _copy_tensor(ckpt, n, e, places[n], tp, lanes, chunk_bytes)
            shown.update(1, math.prod(e.shape) * TORCH_DTYPES[e.dtype].itemsize)
        for lane in lanes:
            lane.close()
    except BaseException as e:
        for lane in lanes:
            lane.cancel()
        for sw in writers:
            sw.__exit__(type(e), e, None)  # closes the file without finishing it
        raise
    for t, sw in enumerate(writers):
        cw.close_file(shard_file(stage, t), sw)


def _copy_tensor(
    ckpt: CheckpointReader, name: str, entry: TensorEntry, p: TensorPlace, tp: int, lanes, chunk_bytes: int
) -> None:
    """Stream one tensor in row blocks, appending each tp rank's part to its file."""
    shape, dim = list(entry.shape), p.tp_dim
    if not shape:
        lanes[0].put((name, ckpt.read(name)))
        ckpt.release()
        return
    itemsize = TORCH_DTYPES[entry.dtype].itemsize
    rows = max(1, chunk_bytes // max(1, math.prod(shape[1:]) * itemsize))
    part = shape[dim] // tp if dim is not None else 0
    # Blocks never straddle a source piece's rows (or a target rank's): a block then usually comes
    # from one piece and is read with a single copy.
    cuts = {0, shape[0]}
    for piece in entry.pieces:
        cuts.update((piece.offset[0], piece.offset[0] + piece.shape[0]))
    if dim == 0:
        cuts.update(t * part for t in range(tp))
    blocks = [
        (r0, min(rows, b - r0)) for a, b in itertools.pairwise(sorted(cuts)) for r0 in range(a, b, rows)
    ]
    for r0, n in blocks:
        block = ckpt.read(name, ((r0, *[0] * (len(shape) - 1)), (n, *shape[1:])))
        ckpt.release()  # drop the memory maps: their touched pages would count as resident
        if dim is None:
            lanes[0].put((name, block))
        elif dim == 0:
            for t in range(tp):
                lo, hi = max(r0, t * part), min(r0 + n, (t + 1) * part)
                if hi > lo:
                    lanes[t].put((name, block[lo - r0 : hi - r0]))
        else:
            for t in range(tp):
                # A strided view: the writer's thread makes it contiguous, off the reading thread.
                lanes[t].put((name, block.narrow(dim, t * part, part)))
        del block
