"""`TensorMap`: one description of how HF tensors map onto ours, used in both directions (convert
splits, export fuses), and the helpers the families build their name maps from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are moved: reading a config.json needs none
    import torch


def _identity(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return ts


@dataclass(frozen=True)
class TensorMap:
    """HF tensors <-> ours. `split` turns the HF tensors (in `hf` order) into ours (in `ours` order),
    `fuse` is its exact inverse (export); both only slice, stack and concatenate, so round trips
    are bit-exact. Most maps are one tensor to one (`rename`); Falcon's fused q/k/v is one to
    three, an MoE layer's per-expert HF matrices many to one stacked tensor (`stacked`)."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    split: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] = field(default=_identity)
    fuse: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] = field(default=_identity)


def rename(hf: str, ours: str) -> TensorMap:
    """One HF tensor that is one of ours under another name (most of them)."""
    return TensorMap((hf,), (ours,))


def linear(maps: list[TensorMap], hf: str, ours: str, bias: bool) -> None:
    """Append a linear layer's weight map to `maps`, and its bias's where it has one."""
    maps.append(rename(f"{hf}.weight", f"{ours}.weight"))
    if bias:
        maps.append(rename(f"{hf}.bias", f"{ours}.bias"))


def _stack(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    import torch

    return (torch.stack(ts),)


def _unstack(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(ts[0].unbind(0))


def stacked(hf: list[str], ours: str) -> TensorMap:
    """The experts' matrices, one HF tensor each, as our one tensor stacked on a leading dim."""
    return TensorMap(tuple(hf), (ours,), _stack, _unstack)
