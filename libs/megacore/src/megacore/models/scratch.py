"""Reused scratch buffers for large temporaries on CPU (the fused loss's logits).

On CPU every fresh tensor above glibc's mmap threshold (at most 32 MiB) is new memory from the
kernel, and first touching it page-faults: a fresh 128 MiB logits buffer costs about 40 ms before any
arithmetic, as much as the matmul that fills it. These temporaries never outlive the function that
asks for them, so one buffer per purpose is kept and reused. Accelerators have caching allocators;
there this is plain `torch.empty`.
"""

from __future__ import annotations

import math

import torch

_buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [shape] tensor that the next `scratch` call with the same name may overwrite:
    use it only until then, and never return it or save it for backward."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    key = (name, dtype, device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)
