"""Hugging Face interop, in memory: config.json <-> ModelConfig and tensor names both ways
(mega-convert streams HF -> checkpoint with these, mega-export checkpoint -> HF; no file I/O here).

Vocab padding: the embedding / lm_head rows are `padded_vocab_size` (`megacore.config.pad_vocab`);
the extra rows are zero in a converted checkpoint and are dropped again on export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import (
    TensorMap,
    family_of,
)
from megacore.parts import model_tensors

VOCAB_TENSORS = ("embed.weight", "lm_head.weight")


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return family_of(config).tensor_maps(config)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and the shapes a checkpoint of this config must have."""
    ours = model_tensors(config)
    out = {}
    for m in tensor_maps(config):
        metas = tuple(torch.empty(_unpadded(n, ours[n], config), device="meta") for n in m.ours)
        for name, t in zip(m.hf, m.fuse(metas), strict=True):
            out[name] = tuple(t.shape)
    return out


def _unpadded(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
    return (config.vocab_size, *shape[1:]) if name in VOCAB_TENSORS else shape


def left_out(config: ModelConfig, names: list[str]) -> str | None:
    """The line that says which of a checkpoint's tensors convert leaves out by design (a family's
    `extra_tensors`: DeepSeek V3's multi-token-prediction layers), None when none."""
    extra = getattr(family_of(config), "extra_tensors", None)
    return None if extra is None else extra(config, names)[1]


def check_maps(config: ModelConfig) -> None:
    """The name map covers the decoder's state dict exactly (a bug guard, not a user error)."""
    mapped = [n for m in tensor_maps(config) for n in m.ours]
    expected = set(model_tensors(config))
    if sorted(mapped) != sorted(expected):
        raise AssertionError(f"name map mismatch: {sorted(set(mapped) ^ expected)}")


def import_tensors(
    config: ModelConfig, get: Callable[[str], torch.Tensor], where: str = "model"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, tensor) for every HF tensor, the HF tensors of one map in memory at a time
    (one, or one layer's experts). `get(name)` returns the HF tensor; a missing tensor or a wrong
    shape is a UserError. Vocab rows are padded."""
    expected = hf_shapes(config)
    vocab = config.padded_vocab_size
    for m in tensor_maps(config):
        ts = tuple(get(name) for name in m.hf)
        for name, t in zip(m.hf, ts, strict=True):
            if tuple(t.shape) != expected[name]:
                raise UserError(
                    f"tensor {name}: shape {list(t.shape)}, config.json implies {list(expected[name])}",
                    where,
                )
        for name, part in zip(m.ours, m.split(ts), strict=True):
            if name in VOCAB_TENSORS and vocab > part.shape[0]:
                part = torch.cat([part, part.new_zeros(vocab - part.shape[0], *part.shape[1:])])
            yield name, part.contiguous()


def export_tensors(
    config: ModelConfig, get: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from our tensors (`get(our name)`): the inverse of `import_tensors`."""
    for m in tensor_maps(config):
        parts = tuple(get(n)[: config.vocab_size] if n in VOCAB_TENSORS else get(n) for n in m.ours)
        for name, t in zip(m.hf, m.fuse(parts), strict=True):
            yield name, t.contiguous()


def hf_state_dict_to_ours(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory convenience (tests, small models): HF state dict -> our state dict."""

    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise UserError(f"tensor {name} is missing", "state dict")
        return hf_state[name]

    return dict(import_tensors(config, get, "state dict"))
