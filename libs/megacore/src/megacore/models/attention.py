"""Causal self-attention kernels: FlashAttention 2 when installed and usable, else PyTorch SDPA.

Inputs are [B, S, heads, head_dim] (FlashAttention's native layout); k/v may have fewer heads than q
(GQA/MQA), the group size is read from the shapes so a tensor-parallel shard works unchanged.
A sliding window (Mistral) limits each query to the `window` most recent keys, itself included; it
changes the result only when the sequence is longer than the window, and only then is a mask built.
Packed documents (`segments` [B, S], a document id per token) see only their own document: a
block-causal mask for SDPA, FlashAttention's variable-length kernel on a GPU.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

Impl = Literal["auto", "sdpa", "flash"]


@functools.cache
def _flash_attn_func():
    """flash_attn_func, or None when the optional extra is not installed (imported on first use only)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _flash_varlen(q, k, v, segments: torch.Tensor, window_size: tuple[int, int]) -> torch.Tensor:
    """FlashAttention over the documents of every row as one ragged batch (no mask, no padding)."""
    from flash_attn import flash_attn_varlen_func

    b, s, hq, d = q.shape
    new = torch.ones_like(segments, dtype=torch.bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = new.flatten().nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    flat = (t.reshape(b * s, t.shape[2], d) for t in (q, k, v))
    out = flash_attn_varlen_func(*flat, cu, cu, longest, longest, causal=True, window_size=window_size)
    return out.view(b, s, hq, d)


def document_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, S, S], True where key j is visible from query i: j <= i in the same document
    (and i - window < j)."""
    s = segments.shape[1]
    ones = torch.ones(s, s, dtype=torch.bool, device=segments.device)
    causal = ones.tril() if window is None else ones.tril().triu(-(window - 1))
    return (segments[:, :, None] == segments[:, None, :]).logical_and_(causal)[:, None]


def flash_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_func() is not None


@functools.lru_cache(maxsize=8)
def _window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [S, S] mask, True where key j is visible from query i: i - window < j <= i."""
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return ones.tril().triu(-(window - 1))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    impl: Impl = "auto",
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal [+ window] [+ documents]) v for q [B,S,Hq,D], k/v [B,S,Hkv,D];
    returns [B,S,Hq,D]. `segments` [B, S]: each token's document id (packed documents)."""
    seq_len = q.shape[1]
    windowed = window is not None and seq_len > window
    if impl == "flash" or (impl == "auto" and flash_usable(q)):
        fn = _flash_attn_func()
        if fn is None:
            raise RuntimeError(
                "attention 'flash' asked for but flash-attn is not installed (pip install 'megacore[flash]')"
            )
        window_size = (window - 1, 0) if windowed else (-1, -1)
        if segments is not None:
            return _flash_varlen(q, k, v, segments, window_size)
        return fn(q, k, v, causal=True, window_size=window_size)
    # SDPA wants [B, heads, S, D]; transposed views avoid copies (the kernels take strided inputs).
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    if segments is not None:
        mask = document_mask(segments, window if windowed else None)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    elif windowed:
        mask = _window_mask(seq_len, window, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)
