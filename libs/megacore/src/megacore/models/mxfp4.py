"""MXFP4 (OCP Microscaling FP4), as gpt-oss's published checkpoints store their experts, dequantized
so that mega-convert reads them like any other weight (no file I/O here: the reader is convert's).

A tensor `X` is stored as `X_blocks` (uint8 [E, rows, G, 16]: each byte two E2M1 values, the low
nibble first) and `X_scales` (uint8 [E, rows, G]: one E8M0 exponent, bias 127, per 32 values).
Dequantized, it is in transformers' parameter layout, [E, G*32, rows] (`convert_moe_packed_tensors`
in transformers/integrations/mxfp4.py, which tests/convert/test_mxfp4.py holds it equal to).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megacore.errors import UserError

BLOCKS = "_blocks"
SCALES = "_scales"
# quant_method -> the model types whose checkpoints mega-convert dequantizes.
SUPPORTED = {"mxfp4": ("gpt_oss",)}

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0-7; bit 3 is the sign


def _byte_values() -> torch.Tensor:
    """[256, 2] float64: a byte's two E2M1 values, the low nibble's first."""
    code = torch.arange(16)
    value = torch.tensor(_E2M1 * 2, dtype=torch.float64) * torch.where(code < 8, 1.0, -1.0)  # 8: -0.0
    byte = torch.arange(256)
    return torch.stack([value[byte & 15], value[byte >> 4]], dim=1)


# float64 holds every product exactly (2-bit mantissas times 2**-127 .. 2**128), so each value is
# rounded once, to the output dtype: ldexp's result, transformers' (scale 255, E8M0's NaN, included).
_BYTES = _byte_values()
_SCALES = torch.tensor([2.0 ** (e - 127) for e in range(256)], dtype=torch.float64)


def dequantized_shape(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, int, int]:
    """The shape of the tensor stored as blocks and scales of these shapes; ValueError if they are not
    an MXFP4 pair."""
    if len(blocks) != 4 or blocks[3] != 16 or tuple(scales) != tuple(blocks[:3]):
        raise ValueError(
            f"blocks {list(blocks)} and scales {list(scales)} are not MXFP4 (expected [E, rows, G, 16] "
            "and [E, rows, G])"
        )
    experts, rows, groups, _ = blocks
    return experts, groups * 32, rows


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, chunk: int = 1 << 24
) -> torch.Tensor:
    """The tensor `blocks` and `scales` store, in `dtype`, [E, G*32, rows]; at most `chunk` values are
    in float64 at a time (a 120B layer's gate_up is 2.1G values)."""
    shape = dequantized_shape(tuple(blocks.shape), tuple(scales.shape))
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    experts, width, rows = shape
    out = torch.empty(shape, dtype=dtype, device=blocks.device)
    values, powers = _BYTES.to(blocks.device), _SCALES.to(blocks.device)
    step = max(1, chunk // max(1, width))
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            v = values[blocks[e, r0:r1].int()].view(r1 - r0, -1, 32)  # [rows, G, 32]
            v *= powers[scales[e, r0:r1].int()].unsqueeze(-1)
            out[e, :, r0:r1] = v.view(r1 - r0, width).T  # the cast to dtype happens here
    return out


def packed_names(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """`X` -> (`X_blocks`, `X_scales`) for each X both of whose tensors are among `names`."""
    names = set(names)
    pairs = {}
    for n in sorted(names):
        if n.endswith(BLOCKS):
            x = n.removesuffix(BLOCKS)
            if x + SCALES in names:
                pairs[x] = (n, x + SCALES)
    return pairs


def check_quantization(hf: dict[str, Any], where: str) -> bool:
    """Whether a config.json (`hf`) says its weights are MXFP4 (gpt-oss's published checkpoints);
    False when it has no quantization_config, a one-line UserError for any quantization mega-convert
    does not read (another method, or MXFP4 on another model type)."""
    q = hf.get("quantization_config")
    if q is None:
        return False
    if not isinstance(q, dict):
        raise UserError(f"$.quantization_config: expected an object, got {q!r}", where)
    method, model_type = q.get("quant_method"), hf.get("model_type")
    if isinstance(method, str) and model_type in SUPPORTED.get(method, ()):
        return True
    supported = "; ".join(f"{m!r} for model_type {', '.join(map(repr, t))}" for m, t in SUPPORTED.items())
    raise UserError(
        f"$.quantization_config.quant_method: {method!r} (model_type {model_type!r}) is not supported "
        f"(supported: {supported}); save the model unquantized with transformers first",
        where,
    )
