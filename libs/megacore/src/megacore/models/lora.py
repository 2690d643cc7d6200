"""LoRA adapters on a Decoder's linears (`megacore.models.adapters` has the rules), no parallel code.

`add_lora` gives each targeted nn.Linear two more linears, `lora_A` [rank, in] and `lora_B`
[out, rank] (PEFT's module names, so the state dict reads `layers.3.attn.q_proj.lora_A.weight`),
and a forward hook adding scale · B(A(dropout(x))) to the linear's output. A hook, not another
module class: a parallel plan applied before keeps its styles on the linear, and the hook runs
first among its forward hooks, on what the linear computed (under tensor parallel a DTensor, whose
row-parallel partial sums then take the adapter's part in the same reduction). The fused q/k/v and
gate/up projections (`decoder.project`) add `delta` themselves. `freeze_base` leaves only the
adapters trainable; `merged` is W + scale · B A (export).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megacore.config import is_adapter_tensor


def delta(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's part of `linear`'s output for input x: scale · B(A(dropout(x)))."""
    return linear.lora_B(linear.lora_A(linear.lora_dropout(x))) * linear.lora_scale


def has_adapter(linear: nn.Module) -> bool:
    return getattr(linear, "lora_A", None) is not None


def _add_delta(linear: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out + delta(linear, args[0])


def add_lora(model: nn.Module, modules: Iterable[str], rank: int, scale: float, dropout: float = 0.0) -> None:
    """Adapters on `model`'s linears named `modules` (contract names), built where their weights
    are (the meta device while a stage is built), in the weights' dtype."""
    for name in modules:
        linear = model.get_submodule(name)
        out_features, in_features = linear.weight.shape
        kw = {"bias": False, "device": linear.weight.device, "dtype": linear.weight.dtype}
        linear.lora_A = nn.Linear(in_features, rank, **kw)
        linear.lora_B = nn.Linear(rank, out_features, **kw)
        linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        linear.lora_scale = scale
        linear.register_forward_hook(_add_delta, prepend=True)


def freeze_base(model: nn.Module) -> None:
    """Only the adapters are trained: every other parameter gets no gradient."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_tensor(name))


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The base weight with its adapter folded in, W + scale · B A, computed in fp32 and returned
    in the weight's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
