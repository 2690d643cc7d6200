"""QLoRA's frozen base: the blocks' projection weights stored in NF4 (torchao's NF4Tensor, as
torchtune stores them), dequantized per matmul, no parallel code.

NF4 is QLoRA's 4-bit normal-float code: blocks of NF4_BLOCK values share an absmax scale, and the
scales are quantized again to int8 in blocks of NF4_SCALER_BLOCK (double quantization), about 0.52
bytes a weight in all (`config.nf4_bytes`). Which weights (the blocks' projections) and in which
layouts: `parallel.layout.check_nf4`. torchao's NF4Tensor keeps the codes and scales and runs `F.linear` on it by
dequantizing to the input's dtype, in forward and for the input's gradient (the weight gets none);
FSDP2 all-gathers its codes and scales (`fsdp_pre_all_gather`).

`quantize_base` swaps the weights for NF4 on the meta device, before FSDP2 shards them (so that
its shards are NF4 shards); `materialize` completes what `to_empty` leaves on the meta device;
`fill` quantizes a whole tensor, as one process would, and copies a rank's rows of it, so that
every layout holds the same codes; `dequantized` is that tensor as the run's matmuls see it (an
export merged as trained). torchao is imported here only, when NF4 is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megacore.config import NF4_BLOCK, NF4_SCALER_BLOCK, nf4_scaler_block


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (a parameter, or a DTensor's local piece) is stored in NF4."""
    return type(t).__name__ == "NF4Tensor"


def quantize(t: torch.Tensor, block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK) -> torch.Tensor:
    """`t` in NF4 with double-quantized scales (on the meta device: the shapes only), in blocks of
    `block` values and scaler blocks of `scaler_block` at most (`config.nf4_scaler_block`)."""
    from torchao.quantization import to_nf4

    return to_nf4(t.detach().contiguous(), block, nf4_scaler_block(t.numel(), block, scaler_block))


def dequantized(
    t: torch.Tensor, block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK
) -> torch.Tensor:
    """The whole tensor `t` as QLoRA's run holds it (quantized whole from fp32, as `fill` does) and
    its matmuls see it: its NF4 round trip, in fp32 (a QLoRA adapter merged as trained)."""
    return quantize(t.float(), block, scaler_block).get_original_weight()


def quantize_base(model: nn.Module, modules: Iterable[str]) -> None:
    """The weights of `model`'s linears named `modules` become frozen NF4 parameters, in place."""
    for name in modules:
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(quantize(linear.weight), requires_grad=False)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The NF4Tensor a parameter holds: its own, or a DTensor's local piece (the object FSDP2
    all-gathers from, not a view of it)."""
    return getattr(p, "_local_tensor", p)


def materialize(model: nn.Module) -> None:
    """After `to_empty`: torchao's empty_like moves the codes and scales of an NF4 tensor only, its
    scales' mean and its code table stay on the meta device; `fill` copies them in."""
    for p in model.parameters():
        t = _local(p)
        if is_nf4(t) and t.nf4.is_meta:
            device = t.quantized_data.device
            t.nf4 = torch.empty(t.nf4.shape, dtype=t.nf4.dtype, device=device)
            t.scaler_mean = torch.empty(t.scaler_mean.shape, dtype=t.scaler_mean.dtype, device=device)


@torch.no_grad()
def fill(p: torch.Tensor, full: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """Quantize the whole tensor `full` and copy the rows [offset, offset + shape) of it into the
    NF4 parameter `p` (whole, or FSDP2's shard of rows)."""
    q = quantize(full.to(device=_local(p).device, dtype=p.dtype))
    if tuple(shape) != tuple(full.shape):  # the codes and scales of whole rows, row-major
        q = torch.split(q, shape[0])[offset[0] // shape[0]]
    _local(p).copy_(q)
