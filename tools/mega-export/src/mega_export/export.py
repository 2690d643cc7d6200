"""Checkpoint artifact (any layout) -> Hugging Face model directory, one tensor in memory at a time.

The directory is written like every artifact (staged in `<out>.partial/`, renamed into place, the
output policy of megacore.artifacts.output): config.json, model*.safetensors (with an index above
`max_shard_bytes`), the tokenizer, a model card (`README.md`, from the checkpoint's lineage) and
a `manifest.json` of kind `hf` that transformers ignores and
that lets a rerun reuse or replace the directory. The tokenizer of a checkpoint mega-train wrote is
the one its data was tokenized with, written so that `AutoTokenizer` encodes as the data was
encoded (megacore.models.hf_tokenizer); one mega-convert wrote carries the source model's files.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from mega_export import __version__
from mega_export.adapter import merge_target, open_weights, write_peft
from mega_export.card import model_card
from megacore.artifacts import (
    TORCH_DTYPES,
    ArtifactWriter,
    HFManifest,
    SafetensorsStreamWriter,
    new_header_fields,
    parent_of,
)
from megacore.artifacts.header import float_dtype
from megacore.artifacts.output import recipe_sha256, reusable, write_artifact
from megacore.checkpoint import CheckpointReader
from megacore.config import ModelConfig, RouterLosses
from megacore.errors import UserError
from megacore.models import config_to_hf, export_tensors, hf_shapes
from megacore.models.hf_tokenizer import checkpoint_tokenizer_files
from megacore.progress import Progress

MAX_SHARD_BYTES = 5 << 30


def _shards(shapes: dict[str, tuple[int, ...]], elem: int, max_bytes: int) -> list[list[str]]:
    """HF tensor names per safetensors file, planned from shapes alone so that each file's header is
    written before its data."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * elem
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_tokenizer(ckpt: CheckpointReader, w: ArtifactWriter) -> None:
    """The checkpoint's tokenizer as Hugging Face files, into the export being staged by `w`."""
    try:
        made = checkpoint_tokenizer_files(ckpt.root, ckpt.manifest, ckpt.config)
    except ValueError as e:  # an unconvertible .model, ids past the embedding rows
        raise UserError(f"tokenizer: {e}", str(ckpt.path)) from None
    for name, data in made.items():
        w.path(name).write_bytes(data)


def _write_weights(
    get: Callable[[str], torch.Tensor],
    config: ModelConfig,
    w: ArtifactWriter,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    max_shard_bytes: int,
    shown: Progress,
) -> list[str]:
    """The weights as safetensors files (`_shards`), with an index when there are several; returns
    the files' names. `get(name)`: our tensor `name`, whole."""
    elem = TORCH_DTYPES[dtype].itemsize
    shards = _shards(shapes, elem, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    tensors = export_tensors(config, get)
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        decl = [(n, dtype, shapes[n]) for n in names]
        with SafetensorsStreamWriter(w.path(file), decl, metadata={"format": "pt"}) as sw:
            for n in names:
                hf_name, t = next(tensors)
                assert hf_name == n
                sw.write(n, t.to(TORCH_DTYPES[dtype]))
                shown.update(1, t.numel() * elem)
        w.record(file, sw.close(), sw.size)
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        total = sum(math.prod(s) * elem for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        w.path("model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def export_hf(
    checkpoint: Path,
    out: Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    force: bool = False,
    progress: bool | None = None,
    adapter: bool = False,
    base: Path | None = None,
    merge_into: str | None = None,
) -> dict[str, Any]:
    """Write `checkpoint` as a Hugging Face model directory at `out`; returns a summary. A LoRA
    adapter checkpoint: the merged model (its base's weights with W + scale · B A; `merge_into`:
    the base as QLoRA trained against it, nf4, or as stored, `mega_export.adapter.merge_target`),
    or with `adapter` a PEFT adapter directory (`mega_export.adapter`); `base` where its base
    checkpoint is now, when it moved."""
    t0 = time.perf_counter()
    checkpoint, out = Path(checkpoint), Path(out)
    with CheckpointReader(checkpoint) as ckpt, ExitStack() as stack:
        # Either spelling (bf16 or bfloat16), as mega-convert takes it; the default, the checkpoint's.
        config, dtype = ckpt.config, float_dtype(dtype) if dtype is not None else ckpt.manifest.dtype
        merge_into = merge_target(ckpt, adapter, merge_into)
        weights = open_weights(ckpt, adapter, base, stack, merge_into)
        parents = [parent_of(checkpoint)] + ([parent_of(weights.base)] if weights.base is not None else [])
        qlora = ckpt.manifest.adapter is not None and ckpt.manifest.adapter.base_dtype == "nf4"
        recipe = recipe_sha256(
            checkpoint=parents[0].manifest_sha256, dtype=dtype, max_shard_bytes=max_shard_bytes,
            **({"adapter": True} if adapter else {}), **({"merge_into": merge_into} if qlora else {}),
        )  # fmt: skip
        summary: dict[str, Any] = {"out": str(out), "dtype": dtype, "family": config.family}
        summary |= {"merged_into": merge_into} if merge_into is not None else {}
        if not force and (old := reusable(out, "hf", recipe)) is not None:
            files = sorted(e.path for e in old.files if e.path.endswith(".safetensors"))
            return {**summary, "reused": True, "files": files, "seconds": round(time.perf_counter() - t0, 3)}
        inputs = [checkpoint] + ([weights.base] if weights.base is not None else [])
        with write_artifact(out, "hf", inputs=inputs, force=force, recipe=recipe) as w:
            if adapter:
                files, count = write_peft(ckpt, w, dtype)
            else:
                files, count = _write_model(ckpt, weights.get, w, dtype, max_shard_bytes, progress)
            card = model_card(out.name, ckpt.manifest, merge_into)
            w.path("README.md").write_text(card, encoding="utf-8")
            _write_tokenizer(ckpt, w)
            weights.confirm()  # the checkpoints' sums, hashed meanwhile: a damaged one leaves no output
            w.commit(
                HFManifest(**new_header_fields("mega-export", __version__), parents=parents, dtype=dtype)
            )
    return {
        **summary,
        "reused": False,
        "files": files,
        "tensors": count,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _write_model(
    ckpt: CheckpointReader,
    get: Callable[[str], torch.Tensor],
    w: ArtifactWriter,
    dtype: str,
    max_shard_bytes: int,
    progress: bool | None,
) -> tuple[list[str], int]:
    """The model's weights (`get`) and config.json; (the files, the tensors)."""
    config = ckpt.config
    shapes = hf_shapes(config)
    total = sum(math.prod(s) * TORCH_DTYPES[dtype].itemsize for s in shapes.values())
    shown = Progress("mega-export", "tensors", total=len(shapes), total_bytes=total, enabled=progress)
    files = _write_weights(get, config, w, shapes, dtype, max_shard_bytes, shown)
    training = ckpt.manifest.training
    router = RouterLosses.from_fingerprint(training.fingerprint) if training is not None else None
    w.path("config.json").write_text(json.dumps(config_to_hf(config, dtype, router), indent=2) + "\n")
    shown.done()
    return files, len(shapes)
