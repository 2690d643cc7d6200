"""Hugging Face model directory -> tp1/pp1 checkpoint artifact, streaming tensor by tensor.

Only config.json and safetensors files are read (a single `model.safetensors`, a sharded set with
`model.safetensors.index.json`, or any `*.safetensors`); pickled `.bin` checkpoints are refused.
The model card's front matter (README.md) gives the license the checkpoint carries on; the
directory, and its Hub id and commit when it is a Hub cache snapshot, are recorded as `hf_source`.
MXFP4 tensors (gpt-oss's experts, `models/mxfp4.py`) are read as the one tensor they store,
dequantized on read into the checkpoint's own float dtype; any other quantization is refused.
One HF tensor is in memory at a time, so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open

from mega_convert import __version__
from megacore.artifacts import TORCH_DTYPES, whole
from megacore.artifacts.header import FLOAT_DTYPES, float_dtype
from megacore.artifacts.manifest import HFSource, Layout, License
from megacore.artifacts.output import recipe_sha256, reusable, write_artifact
from megacore.artifacts.pieces import SAFETENSORS_CODES, safetensors_header
from megacore.artifacts.reader import hub_snapshot
from megacore.background import Background
from megacore.checkpoint import CheckpointWriter, shard_file
from megacore.config import DEFAULT_PAD_MULTIPLE, ModelConfig
from megacore.errors import UserError
from megacore.models import check_maps, config_from_hf, hf_shapes, import_tensors, mxfp4, tensor_maps
from megacore.models.families import language_prefix, training_settings_note
from megacore.models.families.hf_config import read_config_json
from megacore.models.hf import left_out
from megacore.parts import model_tensors
from megacore.progress import Progress

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
WEIGHTS = shard_file(0, 0)  # the tp1/pp1 layout: one file
INDEX = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's config.json (`families.read_config_json`): the weights beside it are read too."""
    if not model_dir.is_dir():
        raise UserError("not a directory (expected a Hugging Face model directory)", str(model_dir))
    return read_config_json(model_dir)


def read_license(model_dir: Path) -> License | None:
    """The license the model card (README.md) states in its front matter, as the Hub reads it."""
    card = model_dir / "README.md"
    if not card.is_file():
        return None
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(card) or {}
    except Exception as e:  # YAML errors, a front matter that is not a mapping, bad UTF-8
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"the model card's front matter is not valid YAML ({why})", str(card)) from None
    lic = meta.get("license")
    if lic is None:
        return None
    fields = {
        "license": lic,
        "license_name": meta.get("license_name"),
        "license_link": meta.get("license_link"),
    }
    for key, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise UserError(f"front matter: {key} should be a string, got {value!r}", str(card))
    return License(id=lic, name=fields["license_name"], link=fields["license_link"])


@dataclass(frozen=True)
class Packed:
    """An MXFP4 tensor as the checkpoint stores it: its blocks and scales tensors, each in its file."""

    blocks: str
    scales: str
    blocks_file: Path
    scales_file: Path


@dataclass(frozen=True)
class Stored:
    """A tensor the checkpoint holds under another name (a multimodal checkpoint's language model:
    `model.language_model.X` read as `model.X`), in its file."""

    name: str
    file: Path


Where = dict[str, Path | Packed | Stored]  # HF tensor name -> what holds it


def language_model(hf: dict[str, Any], where: Where) -> Where:
    """`where` as a language model's tensors: a multimodal checkpoint's under its prefix
    (`families.language_prefix`) named as the language model's own (`model.`), the rest as they are
    (the vision encoder, which the family's `extra_tensors` says it leaves out)."""
    prefix = language_prefix(hf)
    if prefix is None:
        return where
    out: Where = {}
    for name, held in where.items():
        if name.startswith(prefix) and isinstance(held, Path):
            out["model." + name.removeprefix(prefix)] = Stored(name, held)
        else:
            out[name] = held
    return out


def weight_files(model_dir: Path, *, mxfp4_pairs: bool = False) -> Where:
    """HF tensor name -> safetensors file holding it; with `mxfp4_pairs` (`mxfp4.check_quantization`
    said so), each `X_blocks` + `X_scales` pair is one tensor `X`."""
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
        for k in safetensors_header(f):
            if k != "__metadata__":
                where.setdefault(k, f)
    if not mxfp4_pairs:
        return where
    packed: Where = {}
    for name, (blocks, scales) in mxfp4.packed_names(where).items():
        if name not in where:  # a plain X beside an X_blocks + X_scales is the one read
            packed[name] = Packed(blocks, scales, where.pop(blocks), where.pop(scales))
    return {**where, **packed}


def files_of(where: Where) -> list[Path]:
    """The safetensors files `where` reads, each once."""
    files = set()
    for v in where.values():
        if isinstance(v, Packed):
            files.update((v.blocks_file, v.scales_file))
        else:
            files.add(v.file if isinstance(v, Stored) else v)
    return sorted(files)


def check_hf_tensors(config: ModelConfig, where: Where, model_dir: Path) -> None:
    """Every tensor the config implies is present with its shape (read from the safetensors headers
    only), so a bad input fails before anything is written."""
    check_shapes(hf_shapes(config), where, model_dir)


def check_shapes(shapes: dict[str, tuple[int, ...]], where: Where, model_dir: Path) -> None:
    """Each of `shapes`' tensors is in `where` with that shape (an MXFP4 one's dequantized shape)."""
    headers: dict[Path, dict] = {}

    def entry(name: str, f: Path) -> dict:
        if f not in headers:
            headers[f] = safetensors_header(f)
        return headers[f][name]

    for name, shape in shapes.items():
        held = where.get(name)
        if held is None:
            raise UserError(_missing(name, where), str(model_dir))
        if isinstance(held, Packed):
            f = held.blocks_file
            got = _packed_shape(name, entry(held.blocks, f), entry(held.scales, held.scales_file), f)
        elif isinstance(held, Stored):
            f = held.file
            got = tuple(entry(held.name, f)["shape"])
        else:
            f = held
            got = tuple(entry(name, f)["shape"])
        if got != shape:
            raise UserError(f"tensor {name}: shape {list(got)}, config.json implies {list(shape)}", str(f))


def _missing(name: str, where: Where) -> str:
    """Why tensor `name` is not in `where`, with what there is of an MXFP4 pair of that name."""
    pair = [n for n in (name + mxfp4.BLOCKS, name + mxfp4.SCALES) if n in where]
    if len(pair) == 2:
        why = f" ({pair[0]} and {pair[1]} are MXFP4, but config.json has no quantization_config)"
    else:
        why = f" (only {pair[0]} of its MXFP4 pair is there)" if pair else ""
    return f"tensor {name} is missing from the safetensors files{why}"


def _packed_shape(name: str, blocks: dict, scales: dict, f: Path) -> tuple[int, ...]:
    """The dequantized shape of MXFP4 tensor `name` from its blocks' and scales' header entries."""
    if blocks["dtype"] != "U8" or scales["dtype"] != "U8":
        raise UserError(
            f"tensor {name}: MXFP4 blocks and scales are U8, got {blocks['dtype']} and {scales['dtype']}",
            str(f),
        )
    try:
        return mxfp4.dequantized_shape(tuple(blocks["shape"]), tuple(scales["shape"]))
    except ValueError as e:
        raise UserError(f"tensor {name}: {e}", str(f)) from None


def recipe(model_dir: Path, files: list[Path], options: dict[str, Any]) -> str:
    """What decides the output: config.json bytes, the weight and tokenizer files and the model
    card (name, size, mtime) and the options."""

    def ident(f: Path) -> list:
        st = f.stat()
        return [f.name, st.st_size, st.st_mtime_ns]

    tokenizer = [ident(model_dir / t) for t in TOKENIZER_FILES if (model_dir / t).is_file()]
    card = model_dir / "README.md"
    return recipe_sha256(
        config=(model_dir / "config.json").read_bytes().decode("utf-8", "replace"),
        weights=[ident(f) for f in sorted(set(files))],
        tokenizer=tokenizer,
        **({"card": ident(card)} if card.is_file() else {}),  # recipes of card-less models as before
        **options,
    )


def convert_hf(
    model_dir: Path,
    out: Path,
    *,
    dtype: str | None = None,
    pad_multiple: int = DEFAULT_PAD_MULTIPLE,
    force: bool = False,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Convert; returns a summary. An existing identical conversion at `out` is reused unless `force`."""
    t0 = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    src = _read_source(model_dir, dtype, pad_multiple)
    config = src.config
    summary = {
        "out": str(out),
        "family": config.family,
        "license": src.license.id if src.license else None,
        "dtype": src.dtype,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.padded_vocab_size,
    }
    if not force and reusable(out, "checkpoint", src.recipe) is not None:
        say(f"mega-convert: {out} is already this conversion; reusing it (pass --force to rebuild)")
        return {**summary, "reused": True, "seconds": round(time.perf_counter() - t0, 3)}

    check_hf_tensors(config, src.where, model_dir)
    for line in (left_out(config, list(src.where)), src.note):
        if line is not None:
            say(f"mega-convert: {line}")
    shapes = model_tensors(config)
    order = [n for m in tensor_maps(config) for n in m.ours]  # the order import_tensors yields
    tokenizer_files = _write_checkpoint(src, out, shapes, order, force=force, progress=progress)
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return {
        **summary,
        "reused": False,
        "tensors": len(order),
        "parameters": params,
        "tokenizer_files": tokenizer_files,
        "seconds": round(time.perf_counter() - t0, 3),
    }


@dataclass
class _Source:
    """A Hugging Face model directory as read for a conversion: what it holds and what the output is."""

    model_dir: Path
    config: ModelConfig
    where: Where  # HF tensor name -> its safetensors file (or MXFP4 pair)
    dtype: str  # of the output
    source_dtype: str  # the weights' own (float32 when no tensor is float), MXFP4 dequantized into it
    license: License | None
    recipe: str
    source: HFSource  # where the model came from, for a PEFT export's base_model_name_or_path
    note: str | None  # what of config.json the checkpoint does not carry (`training_settings_note`)


def _read_source(model_dir: Path, dtype: str | None, pad_multiple: int) -> _Source:
    """The config, weight files, output dtype (`dtype`, else the weights' own), license and recipe;
    only config.json, the safetensors headers and the model card are read."""
    dtype = float_dtype(dtype) if dtype is not None else None  # either spelling: bf16 or bfloat16
    hf = read_hf_config(model_dir)
    at = str(model_dir / "config.json")
    config = config_from_hf(hf, at, pad_multiple=pad_multiple)
    check_maps(config)
    where = language_model(hf, weight_files(model_dir, mxfp4_pairs=mxfp4.check_quantization(hf, at)))
    source = source_dtype(where)
    out_dtype = dtype or source
    card_license = read_license(model_dir)
    origin = hf_source(model_dir)
    options = {"dtype": out_dtype, "pad_multiple": pad_multiple, "source": msgspec.to_builtins(origin)}
    rec = recipe(model_dir, files_of(where), options)
    note = training_settings_note(hf, config)
    return _Source(model_dir, config, where, out_dtype, source, card_license, rec, origin, note)


def hf_source(model_dir: Path) -> HFSource:
    """Where a model directory came from: itself (absolute), with its Hub id and commit when it is a
    Hub cache snapshot."""
    snapshot = hub_snapshot(model_dir)
    repo, revision = snapshot if snapshot is not None else (None, None)
    return HFSource(path=str(model_dir.resolve()), repo=repo, revision=revision)


def source_dtype(where: Where) -> str:
    """The dtype of the first float tensor (MXFP4 ones and integer ones have none of their own);
    float32 when there is none."""
    floats = {SAFETENSORS_CODES[name]: name for name in FLOAT_DTYPES}
    headers: dict[Path, dict] = {}
    for name, f in where.items():
        if isinstance(f, Packed):
            continue
        if f not in headers:
            headers[f] = safetensors_header(f)
        if (code := headers[f][name]["dtype"]) in floats:
            return floats[code]
    return "float32"


def _write_checkpoint(
    src: _Source,
    out: Path,
    shapes: dict[str, tuple[int, ...]],
    order: list[str],
    *,
    force: bool,
    progress: bool | None,
) -> list[str]:
    """Stream the weights (in `order`) into one file, copy the tokenizer files and commit;
    returns the tokenizer files' paths in the checkpoint."""
    config, model_dir, out_dtype = src.config, src.model_dir, src.dtype
    torch_dtype = TORCH_DTYPES[out_dtype]
    elem = torch_dtype.itemsize
    total = sum(torch.Size(shapes[n]).numel() * elem for n in order)
    shown = Progress("mega-convert", "tensors", total=len(order), total_bytes=total, enabled=progress)
    with write_artifact(out, "checkpoint", inputs=[model_dir], force=force, recipe=src.recipe) as w:
        cw = CheckpointWriter(w)
        sw = cw.open_file(WEIGHTS, [(n, shapes[n], out_dtype, whole(shapes[n])) for n in order])
        # The next HF tensor is read on a helper thread while this one is written and hashed.
        tensors = Background.source(
            import_tensors(config, tensor_reader(src.where, model_dir, src.source_dtype), str(model_dir)),
            depth=1,
            name="mega-convert-read",
        )
        try:
            with sw:
                for name, t in tensors:
                    sw.write(name, t if t.dtype == torch_dtype else t.to(torch_dtype))
                    shown.update(1, t.numel() * elem)
        finally:
            tensors.close()
        cw.close_file(WEIGHTS, sw)
        tokenizer_files = [
            cw.add_file(model_dir / name, f"tokenizer/{name}")
            for name in TOKENIZER_FILES
            if (model_dir / name).is_file()
        ]
        cw.commit(
            config=config,
            dtype=out_dtype,
            layout=Layout(tp=1, pp=1, dp=1, stage_layers=[list(range(config.num_layers))]),
            producer=("mega-convert", __version__),
            tokenizer_files=tokenizer_files,
            license=src.license,
            hf_source=src.source,
        )
    shown.done()
    return tokenizer_files


def tensor_reader(where: Where, model_dir: Path, dtype: str) -> Callable[[str], torch.Tensor]:
    """An HF tensor by name, read from its file when asked; an MXFP4 one dequantized into `dtype`."""

    def read(name: str, f: Path) -> torch.Tensor:
        # Open per tensor: safetensors memory-maps the file, and pages of a mapping that stays open
        # count as resident, so a long-lived handle would grow RSS to the size of the model.
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)

    def get(name: str) -> torch.Tensor:
        held = where.get(name)
        if held is None:
            raise UserError(_missing(name, where), str(model_dir))
        if isinstance(held, Stored):
            return read(held.name, held.file)
        if not isinstance(held, Packed):
            return read(name, held)
        blocks, scales = read(held.blocks, held.blocks_file), read(held.scales, held.scales_file)
        try:
            return mxfp4.dequantize(blocks, scales, TORCH_DTYPES[dtype])
        except ValueError as e:
            raise UserError(f"tensor {name}: {e}", str(held.blocks_file)) from None

    return get
