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


def concatenated(hf: str, ours: tuple[str, ...], rows: tuple[int, ...]) -> TensorMap:
    """One HF tensor whose rows are ours, one after the other (`rows` each): Qwen 3.5's fused
    q/k/v projection of linear attention and its convolution's filters."""

    def split(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(ts[0].split(list(rows)))

    def fuse(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        import torch

        return (torch.cat(ts),)

    return TensorMap((hf,), ours, split, fuse)


def per_head(hf: str, ours: tuple[str, ...], heads: int, widths: tuple[int, ...] | None = None) -> TensorMap:
    """One HF tensor whose rows hold, head by head, a block of each of ours (`widths` rows each a
    head; equal widths if None): Qwen 3.5's q projection, each head's q rows then its output
    gate's; Qwen3-Next's linear attention inputs, each key head's q, k, then its value heads' v and
    z rows."""

    def split(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        blocks = ts[0].unflatten(0, (heads, -1))
        parts = blocks.split(list(widths), dim=1) if widths else blocks.chunk(len(ours), dim=1)
        return tuple(part.flatten(0, 1) for part in parts)

    def fuse(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        import torch

        return (torch.cat([t.unflatten(0, (heads, -1)) for t in ts], dim=1).flatten(0, 1),)

    return TensorMap((hf,), ours, split, fuse)
