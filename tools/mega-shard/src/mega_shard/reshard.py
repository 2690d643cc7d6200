"""Any tensor/pipeline/expert layout to any other, offline, streaming.

Each tensor is read once, in row blocks of at most `chunk_bytes`, from whatever pieces the source
has (`CheckpointReader` reads only the bytes a block needs), and every tensor-parallel rank's part
of the block (`layout.tp_box`) is appended to that rank's file; with expert parallel `ep`, a
mixture of experts' stacked experts are cut on their experts dim too, each ep rank's experts in
its own file (`model-pp{s}-tp{t}-dp{e}`, as an ep run writes them), the other tensors in ep rank
0's, on a background writer per file so
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
from megacore.artifacts.header import Parent
from megacore.artifacts.manifest import Layout, TensorEntry
from megacore.artifacts.output import recipe_sha256, reusable, write_artifact
from megacore.artifacts.pieces import Box, even_split
from megacore.background import Background
from megacore.checkpoint import CheckpointReader, CheckpointWriter, adapter_copied, shard_file
from megacore.errors import UserError
from megacore.parallel.layout import (
    TensorPlace,
    check_ep,
    check_tp,
    is_experts,
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
    ep: int = 1
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
    ep: int = 1,
    force: bool = False,
    verify: str = "size",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    producer: tuple[str, str] = ("mega-shard", "0.0.0"),
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> ShardResult:
    """Write checkpoint `src` to `out` with tensor parallel `tp`, `pp` pipeline stages and the
    experts split over `ep`."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    with CheckpointReader(src, verify=verify) as ckpt:
        manifest = ckpt.manifest
        layers, places = _check(ckpt, tp, pp, pp_layers, ep)  # every check before anything is written
        parent = parent_of(src)
        result = ShardResult(out=str(out), tp=tp, pp=pp, stage_layers=layers, ep=ep)
        recipe = recipe_sha256(
            checkpoint=parent.manifest_sha256,
            tp=tp,
            pp=pp,
            stage_layers=layers,
            **({"ep": ep} if ep > 1 else {}),
        )
        if not force and reusable(out, "checkpoint", recipe) is not None:
            at = f"tp {tp} pp {pp}" + (f" ep {ep}" if ep > 1 else "")
            log(f"mega-shard: {out} already holds this checkpoint at {at}; reusing it (--force rebuilds)")
            result.reused, result.tensors = True, len(manifest.tensors)
            result.seconds = time.perf_counter() - t0
            return result

        names = sorted(manifest.tensors, key=lambda n: _order_key(n, places[n]))
        total = sum(math.prod(e.shape) * TORCH_DTYPES[e.dtype].itemsize for e in manifest.tensors.values())
        shown = Progress("mega-shard", "tensors", total=len(names), total_bytes=total, enabled=progress)
        with write_artifact(out, "checkpoint", inputs=[src], force=force, recipe=recipe) as w:
            cw = CheckpointWriter(w)
            _write_stages(ckpt, cw, names, places, layers, (tp, ep), chunk_bytes, shown, log)
            _commit(ckpt, cw, Layout(tp=tp, pp=pp, dp=ep, stage_layers=layers), producer, parent, names, out)
        shown.done()
    result.tensors, result.files, result.bytes_written = len(names), cw.files, cw.bytes_written
    result.seconds = time.perf_counter() - t0
    return result


def _check(
    ckpt: CheckpointReader, tp: int, pp: int, pp_layers: Sequence[int] | None, ep: int
) -> tuple[list[list[int]], dict[str, TensorPlace]]:
    """The layout checked against the checkpoint's model: (each stage's layers, each tensor's place)."""
    cfg = ckpt.config
    check_tp(cfg, tp, "--tp")
    check_ep(cfg, ep, "--ep")
    layers = stage_layers(cfg.num_layers, pp, pp_layers, "--pp-layers" if pp_layers else "--pp")
    places = {name: place(name, cfg, tp) for name in ckpt.manifest.tensors}
    for name, e in ckpt.manifest.tensors.items():
        dim = places[name].tp_dim
        if dim is not None and (len(e.shape) <= dim or e.shape[dim] % tp):
            raise UserError(
                f"tensor {name!r} shape {e.shape} does not split into {tp} along dim {dim}", "--tp"
            )
    return layers, places


def _write_stages(
    ckpt: CheckpointReader,
    cw: CheckpointWriter,
    names: list[str],
    places: dict[str, TensorPlace],
    layers: list[list[int]],
    sizes: tuple[int, int],
    chunk_bytes: int,
    shown: Progress,
    log: Callable[[str], None],
) -> None:
    """Every stage's files (`names` in their order), one stage after another, each confirmed."""
    pp, (tp, ep) = len(layers), sizes
    by_stage: list[list[str]] = [[] for _ in range(pp)]
    for n in names:
        by_stage[stage_of(places[n], layers)].append(n)
    for s, stage_names in enumerate(by_stage):
        _write_stage(ckpt, cw, s, stage_names, places, sizes, chunk_bytes, shown)
        # The source's sums, hashed meanwhile, before a stage is said to be written: a
        # damaged file is the one line of output, and leaves no output behind.
        ckpt.confirm()
        log(f"mega-shard: stage {s + 1}/{pp} written ({len(stage_names)} tensors, {tp * ep} files)")


def _commit(
    ckpt: CheckpointReader,
    cw: CheckpointWriter,
    layout: Layout,
    producer: tuple[str, str],
    parent: Parent,
    names: list[str],
    out: Path,
) -> None:
    """The source's other files (tokenizer, rng states) copied, then the manifest: the commit."""
    manifest = ckpt.manifest
    # A LoRA adapter stays one, of the same base, found from `out` as it was from the source.
    adapter = adapter_copied(ckpt.path, manifest.adapter, out) if manifest.adapter else None
    extra = list(manifest.tokenizer_files) + (manifest.training.rng_files if manifest.training else [])
    for rel in extra:
        cw.add_file(ckpt.root / rel, rel)
    tokenizer = cw.add_tokenizer(ckpt.root, manifest.tokenizer) if manifest.tokenizer else None
    cw.commit(
        config=ckpt.config,
        dtype=manifest.dtype,
        layout=layout,
        producer=producer,
        parents=[parent],
        tokenizer_files=manifest.tokenizer_files,
        tokenizer=tokenizer,
        training=manifest.training,
        license=manifest.license,
        order=names,
        adapter=adapter,
        hf_source=manifest.hf_source,  # the same weights, laid out otherwise
    )


def _boxes(name: str, shape: Sequence[int], p: TensorPlace, tp: int, ep: int) -> list[tuple[int, Box]]:
    """(file, part of the tensor) for each file of a stage holding part of it: files are ordered
    by (tp rank, ep rank); a tensor replicated over tp goes to tp rank 0's, one that is not an
    experts tensor to ep rank 0's."""
    out, experts = [], ep if is_experts(name) else 1
    for t in range(tp if p.tp_dim is not None else 1):
        t_off, t_shape = tp_box(p, shape, tp, t)
        for e in range(experts):
            e_off, e_shape = even_split(shape, 0, experts)[e]
            # The two cuts are on different dims: the box is each dim's narrower range.
            box = tuple(map(max, t_off, e_off)), tuple(map(min, t_shape, e_shape))
            out.append((t * ep + e, box))
    return out


def _write_stage(
    ckpt: CheckpointReader,
    cw: CheckpointWriter,
    stage: int,
    names: list[str],
    places: dict[str, TensorPlace],
    sizes: tuple[int, int],
    chunk_bytes: int,
    shown: Progress,
) -> None:
    """The tp x ep files of one pipeline stage (`_boxes`)."""
    tp, ep = sizes
    files = [shard_file(stage, t, e if ep > 1 else None) for t in range(tp) for e in range(ep)]
    boxes = {n: _boxes(n, ckpt.manifest.tensors[n].shape, places[n], tp, ep) for n in names}
    writers, lanes = [], []
    for f, file in enumerate(files):
        entries = ckpt.manifest.tensors
        slices = [
            (n, entries[n].shape, entries[n].dtype, box) for n in names for lane, box in boxes[n] if lane == f
        ]
        writers.append(cw.open_file(file, slices))
        lanes.append(Background.sink(lambda item, sw=writers[-1]: sw.write(*item), depth=QUEUED_BLOCKS))
    try:
        for n in names:
            e = ckpt.manifest.tensors[n]
            _copy_tensor(ckpt, n, e, boxes[n], lanes, chunk_bytes)
            shown.update(1, math.prod(e.shape) * TORCH_DTYPES[e.dtype].itemsize)
        for lane in lanes:
            lane.close()
    except BaseException as e:
        for lane in lanes:
            lane.cancel()
        for sw in writers:
            sw.__exit__(type(e), e, None)  # closes the file without finishing it
        raise
    for file, sw in zip(files, writers, strict=True):
        cw.close_file(file, sw)


def _copy_tensor(
    ckpt: CheckpointReader,
    name: str,
    entry: TensorEntry,
    boxes: list[tuple[int, Box]],
    lanes,
    chunk_bytes: int,
) -> None:
    """Stream one tensor in row blocks, appending each file's part (`boxes`) to it."""
    shape = list(entry.shape)
    if not shape:
        lanes[boxes[0][0]].put((name, ckpt.read(name)))
        ckpt.release()
        return
    itemsize = TORCH_DTYPES[entry.dtype].itemsize
    rows = max(1, chunk_bytes // max(1, math.prod(shape[1:]) * itemsize))
    # Blocks never straddle a source piece's rows (or a target file's): a block then usually comes
    # from one piece and is read with a single copy.
    cuts = {0, shape[0]}
    for piece in entry.pieces:
        cuts.update((piece.offset[0], piece.offset[0] + piece.shape[0]))
    for _, (offset, size) in boxes:
        cuts.update((offset[0], offset[0] + size[0]))
    blocks = [
        (r0, min(rows, b - r0)) for a, b in itertools.pairwise(sorted(cuts)) for r0 in range(a, b, rows)
    ]
    for r0, n in blocks:
        block = ckpt.read(name, ((r0, *[0] * (len(shape) - 1)), (n, *shape[1:])))
        ckpt.release()  # drop the memory maps: their touched pages would count as resident
        for lane, (offset, size) in boxes:
            lo, hi = max(r0, offset[0]), min(r0 + n, offset[0] + size[0])
            if hi <= lo:
                continue
            part = block[lo - r0 : hi - r0]
            for d in range(1, len(shape)):
                if size[d] != shape[d]:
                    # A strided view: the writer's thread makes it contiguous, off the reading thread.
                    part = part.narrow(d, offset[d], size[d])
            lanes[lane].put((name, part))
        del block
