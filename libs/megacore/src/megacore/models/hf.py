"""Hugging Face interop: config.json <-> ModelConfig, tensor names both ways, and an HF directory
writer that streams a checkpoint artifact (any layout) out tensor by tensor (what mega-export uses).

Vocab padding rule: the embedding / lm_head row count is `vocab_size` rounded up to a multiple of
`pad_multiple` (128 by default: divisible by any power-of-two tensor-parallel size up to 128); the
extra rows are zero in a converted checkpoint and are dropped again on export.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from megacore.artifacts.manifest import ModelConfig
from megacore.errors import UserError
from megacore.models.decoder import Decoder, padded_vocab
from megacore.models.families import TensorMap, family_for_model_type, family_of

VOCAB_TENSORS = ("embed.weight", "lm_head.weight")
DEFAULT_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, multiple: int = DEFAULT_PAD_MULTIPLE) -> int:
    if multiple < 1:
        raise UserError(f"vocab pad multiple must be >= 1, got {multiple}")
    return math.ceil(vocab_size / multiple) * multiple


def config_from_hf(
    hf: dict[str, Any] | Any, where: str = "config.json", pad_multiple: int | None = None
) -> ModelConfig:
    """ModelConfig from a HF config: a config.json dict (classic `rope_theta`/`rope_scaling` or
    transformers 5 `rope_parameters`) or a transformers PretrainedConfig. `pad_multiple` sets
    padded_vocab_size (None: no padding)."""
    if not isinstance(hf, dict):
        hf = hf.to_dict()
    fam = family_for_model_type(hf.get("model_type"), where)
    cfg = fam.config_from_hf(hf, where)
    if pad_multiple is not None:
        cfg = msgspec.structs.replace(cfg, padded_vocab_size=padded_vocab_size(cfg.vocab_size, pad_multiple))
    return cfg


def config_to_hf(config: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """A config.json dict that transformers (4.45+ and 5) loads as the matching *ForCausalLM."""
    out = family_of(config).config_to_hf(config)
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return family_of(config).tensor_maps(config)


def decoder_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names and global shapes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = Decoder(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and the shapes a checkpoint of this config must have."""
    ours = decoder_shapes(config)
    out = {}
    for m in tensor_maps(config):
        metas = tuple(torch.empty(_unpadded(n, ours[n], config), device="meta") for n in m.ours)
        out[m.hf] = tuple(m.fuse(metas).shape)
    return out


def _unpadded(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
    return (config.vocab_size, *shape[1:]) if name in VOCAB_TENSORS else shape


def check_maps(config: ModelConfig) -> None:
    """The name map covers the decoder's state dict exactly (a bug guard, not a user error)."""
    mapped = [n for m in tensor_maps(config) for n in m.ours]
    expected = set(decoder_shapes(config))
    if sorted(mapped) != sorted(expected):
        raise AssertionError(f"name map mismatch: {sorted(set(mapped) ^ expected)}")


def import_tensors(
    config: ModelConfig, get: Callable[[str], torch.Tensor], where: str = "model"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, tensor) for every HF tensor, one HF tensor in memory at a time. `get(name)`
    returns the HF tensor; a missing tensor or a wrong shape is a UserError. Vocab rows are padded."""
    expected = hf_shapes(config)
    vocab = padded_vocab(config)
    for m in tensor_maps(config):
        t = get(m.hf)
        if tuple(t.shape) != expected[m.hf]:
            raise UserError(
                f"tensor {m.hf}: shape {list(t.shape)}, config.json implies {list(expected[m.hf])}", where
            )
        for name, part in zip(m.ours, m.split(t), strict=True):
            if name in VOCAB_TENSORS and vocab > part.shape[0]:
                part = torch.cat([part, part.new_zeros(vocab - part.shape[0], *part.shape[1:])])
            yield name, part.contiguous()


def export_tensors(
    config: ModelConfig, get: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from our tensors (`get(our name)`): the inverse of `import_tensors`."""
    for m in tensor_maps(config):
        parts = tuple(get(n)[: config.vocab_size] if n in VOCAB_TENSORS else get(n) for n in m.ours)
        yield m.hf, m.fuse(parts).contiguous()


def hf_state_dict_to_ours(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory convenience (tests, small models): HF state dict -> our state dict."""

    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise UserError(f"tensor {name} is missing", "state dict")
        return hf_state[name]

    return dict(import_tensors(config, get, "state dict"))


def load_checkpoint_state(path: Path, names: list[str] | None = None) -> tuple[ModelConfig, str, Iterator]:
    """(config, dtype, iterator of (name, full tensor)) of a checkpoint artifact in any layout."""
    from megacore.artifacts.layout import TensorReader
    from megacore.artifacts.reader import artifact_root, open_artifact

    manifest = open_artifact(Path(path), "checkpoint", verify="size")
    root = artifact_root(Path(path))

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        with TensorReader(root) as reader:
            for name in names or list(manifest.tensors):
                if name not in manifest.tensors:
                    raise UserError(f"tensor {name} is not in the checkpoint", str(path))
                yield name, reader.read(name, manifest.tensors[name])

    return manifest.config, manifest.dtype, items()


def load_decoder(path: Path, dtype: torch.dtype | None = None) -> Decoder:
    """A whole Decoder with the weights of a checkpoint artifact (any layout; single process)."""
    config, _, items = load_checkpoint_state(path)
    with torch.device("meta"):
        model = Decoder(config)
    model.to_empty(device="cpu")
    state = dict(items)
    for name in [k for k in state if k not in model.state_dict()]:
        del state[name]  # optimizer moments and other training state
    model.load_state_dict(state, strict=True)
    return model if dtype is None else model.to(dtype)


def write_hf_dir(
    checkpoint: Path,
    out: Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    force: bool = False,
) -> dict[str, Any]:
    """Write a Hugging Face model directory (config.json, model*.safetensors [+ index], tokenizer
    files) from a checkpoint artifact in any layout, one tensor in memory at a time. Staged in
    `<out>.partial` and renamed into place. Returns a summary."""
    from megacore.artifacts.layout import TORCH_DTYPES, SafetensorsStreamWriter, TensorReader
    from megacore.artifacts.reader import artifact_root, confined_path, open_artifact

    manifest = open_artifact(Path(checkpoint), "checkpoint", verify="size")
    root = artifact_root(Path(checkpoint))
    config = manifest.config
    dtype = dtype or manifest.dtype
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError("already exists; pass --force to replace it", str(out))
    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    elem = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    shapes = hf_shapes(config)
    # Plan the shards from shapes alone, so each file's header can be written before its data.
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * elem
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with TensorReader(root) as reader:

        def get(name: str) -> torch.Tensor:
            if name not in manifest.tensors:
                raise UserError(f"tensor {name} is missing from the checkpoint", str(checkpoint))
            t = reader.read(name, manifest.tensors[name])
            reader.close()  # unmap: pages of a mapping left open count as resident (RSS ~ model)
            return t

        tensors = export_tensors(config, get)
        for file, names in zip(files, shards, strict=True):
            decl = [(n, dtype, shapes[n]) for n in names]
            with SafetensorsStreamWriter(stage / file, decl, metadata={"format": "pt"}) as w:
                for n in names:
                    hf_name, t = next(tensors)
                    assert hf_name == n
                    w.write(n, t.to(TORCH_DTYPES[dtype]))
            weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        total = sum(math.prod(s) * elem for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (stage / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
    for rel in manifest.tokenizer_files:
        src = confined_path(root, rel, f"{checkpoint}: tokenizer_files")
        shutil.copyfile(src, stage / Path(rel).name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(stage, out)
    return {"out": str(out), "files": files, "tensors": len(shapes), "dtype": dtype}
