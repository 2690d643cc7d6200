"""Hugging Face model directory -> tp1/pp1 checkpoint artifact, streaming tensor by tensor.

Only config.json and safetensors files are read (a single `model.safetensors`, a sharded set with
`model.safetensors.index.json`, or any `*.safetensors`); pickled `.bin` checkpoints are refused.
One HF tensor is in memory at a time, so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from mega_convert import __version__
from megacore.artifacts import (
    CheckpointManifest,
    Piece,
    SafetensorsStreamWriter,
    new_header_fields,
    piece_entry,
    write_artifact,
)
from megacore.artifacts.layout import TORCH_DTYPES
from megacore.artifacts.manifest import MANIFEST_NAME, Layout, ModelConfig
from megacore.artifacts.reader import open_artifact
from megacore.errors import UserError
from megacore.models import (
    DEFAULT_PAD_MULTIPLE,
    check_maps,
    config_from_hf,
    decoder_shapes,
    hf_shapes,
    import_tensors,
    tensor_maps,
)

TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
WEIGHTS = "model.safetensors"
T = TypeVar("T")
INDEX = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise UserError("not a directory (expected a Hugging Face model directory)", str(model_dir))
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError("no config.json: not a Hugging Face model directory", str(model_dir))
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"not valid JSON ({e})", str(path)) from None
    if not isinstance(data, dict):
        raise UserError("expected a JSON object", str(path))
    return data


def weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"not a valid safetensors index ({e})", str(index)) from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        if pickled:
            raise UserError(
                f"only pickled weights ({', '.join(pickled[:3])}); mega-convert reads safetensors only, never "
                "unpickles: re-save with transformers' save_pretrained (safetensors is its default)",
                str(model_dir),
            )
        raise UserError("no *.safetensors weight files", str(model_dir))
    where: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise UserError(f"{f.name} is listed in {INDEX} but missing", str(model_dir))
        try:
            with safe_open(str(f), framework="pt") as h:
                keys = list(h.keys())
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise UserError(f"not a readable safetensors file ({e})", str(f)) from None
        for k in keys:
            where.setdefault(k, f)
    return where


def check_hf_tensors(config: ModelConfig, where: dict[str, Path], model_dir: Path) -> None:
    """Every tensor the config implies is present with its shape (read from the safetensors headers
    only), so a bad input fails before anything is written."""
    handles: dict[Path, Any] = {}
    try:
        for name, shape in hf_shapes(config).items():
            if name not in where:
                raise UserError(f"tensor {name} is missing from the safetensors files", str(model_dir))
            f = where[name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            got = tuple(handles[f].get_slice(name).get_shape())
            if got != shape:
                raise UserError(
                    f"tensor {name}: shape {list(got)}, config.json implies {list(shape)}", str(f)
                )
    finally:
        handles.clear()


def source_fingerprint(model_dir: Path, files: list[Path], options: dict[str, Any]) -> str:
    """What decides the output: config.json bytes, weight files (name, size, mtime), options, version."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(set(files)):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for t in TOKENIZER_FILES:
        if (model_dir / t).is_file():
            h.update(f"{t}:{(model_dir / t).stat().st_size};".encode())
    h.update(json.dumps({**options, "version": __version__}, sort_keys=True).encode())
    return h.hexdigest()


def _existing_fingerprint(out: Path) -> str | None:
    if not (out / MANIFEST_NAME).is_file() or not (out / WEIGHTS).is_file():
        return None
    try:
        open_artifact(out, "checkpoint", verify="size")
        with safe_open(str(out / WEIGHTS), framework="pt") as h:
            return (h.metadata() or {}).get("source_fingerprint")
    except Exception:
        return None


def _prefetch(items: Iterator[T]) -> Iterator[T]:
    """Produce the next item on a helper thread while the caller writes the current one: reading
    and the write + sha256 of the previous tensor overlap (file I/O and hashing release the GIL).
    At most two tensors are alive at once."""
    q: queue.Queue = queue.Queue(maxsize=1)
    done = object()

    def work() -> None:
        try:
            for item in items:
                q.put(item)
            q.put(done)
        except BaseException as e:  # re-raised in the caller's thread
            q.put(e)

    threading.Thread(target=work, daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def convert_hf(
    model_dir: Path,
    out: Path,
    *,
    dtype: str | None = None,
    pad_multiple: int = DEFAULT_PAD_MULTIPLE,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert; returns a summary. An existing identical conversion at `out` is reused unless `force`."""
    t0 = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    hf = read_hf_config(model_dir)
    config = config_from_hf(hf, str(model_dir / "config.json"), pad_multiple=pad_multiple)
    check_maps(config)
    where = weight_files(model_dir)
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    first = next(iter(where))
    with safe_open(str(where[first]), framework="pt") as h:
        source_dtype = h.get_slice(first).get_dtype()
    source = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(source_dtype)
    out_dtype = dtype or source or "float32"
    fingerprint = source_fingerprint(
        model_dir, list(where.values()), {"dtype": out_dtype, "pad_multiple": pad_multiple}
    )
    summary = {
        "out": str(out),
        "family": config.family,
        "dtype": out_dtype,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.padded_vocab_size,
    }
    if not force and _existing_fingerprint(out) == fingerprint:
        say(f"mega-convert: {out} is already this conversion; reusing it (pass --force to rebuild)")
        return {**summary, "reused": True, "seconds": round(time.perf_counter() - t0, 3)}

    check_hf_tensors(config, where, model_dir)
    shapes = decoder_shapes(config)
    torch_dtype = TORCH_DTYPES[out_dtype]

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise UserError(f"tensor {name} is missing from the safetensors files", str(model_dir))
        # Open per tensor: safetensors memory-maps the file, and pages of a mapping that stays open
        # count as resident, so a long-lived handle would grow RSS to the size of the model.
        with safe_open(str(where[name]), framework="pt") as h:
            return h.get_tensor(name)

    tensors = {}
    with write_artifact(out, force=force) as w:
        order = [n for m in tensor_maps(config) for n in m.ours]  # the order import_tensors yields
        decl = [(n, out_dtype, shapes[n]) for n in order]
        with SafetensorsStreamWriter(w.path(WEIGHTS), decl, {"source_fingerprint": fingerprint}) as sw:
            for i, (name, t) in enumerate(_prefetch(import_tensors(config, get, str(model_dir)))):
                sw.write(name, t if t.dtype == torch_dtype else t.to(torch_dtype))
                tensors[name] = piece_entry(
                    shapes[name],
                    out_dtype,
                    [Piece(file=WEIGHTS, key=name, offset=[0] * len(t.shape), shape=list(t.shape))],
                )
                if i % 50 == 0:
                    say(f"mega-convert: {i + 1}/{len(shapes)} tensors")
            sha = sw.close()
        w.record(WEIGHTS, sha, sw.size)
        tokenizer_files = []
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, w.path(f"tokenizer/{name}"))
                tokenizer_files.append(f"tokenizer/{name}")
        manifest = CheckpointManifest(
            **new_header_fields("mega-convert", __version__),
            config=config,
            dtype=out_dtype,
            layout=Layout(tp=1, pp=1, dp=1, stage_layers=[list(range(config.num_layers))]),
            tensors=tensors,
            tokenizer_files=tokenizer_files,
        )
        w.commit(manifest)
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return {
        **summary,
        "reused": False,
        "tensors": len(tensors),
        "parameters": params,
        "tokenizer_files": tokenizer_files,
        "seconds": round(time.perf_counter() - t0, 3),
    }
