"""Causal self-attention kernels: FlashAttention on a GPU, PyTorch SDPA elsewhere.

`flash` is the flash-attn package when installed, else PyTorch's own FlashAttention kernels (SDPA
held to its flash backend; `torch.nn.attention.varlen` for packed documents and windows), so it
means a FlashAttention kernel or an error, never a silent fallback. `auto` takes flash-attn on a GPU
when installed, else SDPA, and for packed documents on a GPU PyTorch's variable-length kernel
rather than an S x S mask.

Inputs are [B, S, heads, head_dim] (FlashAttention's native layout); k/v may have fewer heads than q
(GQA/MQA), the group size is read from the shapes so a tensor-parallel shard works unchanged.
A sliding window (Mistral; Gemma 3's local layers) limits each query to the `window` most recent
keys, itself included; it changes the result only when the sequence is longer than the window, and
only then is a mask built. Every kernel takes the score scale (`scale`, Gemma's not 1 / sqrt(D)).
Packed documents (`segments` [B, S], a document id per token) see only their own document: a
block-causal mask for SDPA, a variable-length kernel (one ragged batch, no mask) on a GPU.
`suffix_attention` is the same for queries that are the last positions of their keys (a late chunk
of a row under context parallel): causal aligned to the bottom right, with the same kernels and no
mask on a GPU. With attention sinks (gpt-oss: `sinks`, a logit per q head) both take
`models.sinks.sink_attention` under the same masks, on any device; no FlashAttention kernel here
has a sink.
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megacore.models.sinks import sink_attention

Impl = Literal["auto", "sdpa", "flash"]


@functools.cache
def _flash_attn_func():
    """flash_attn_func, or None when the optional extra is not installed (imported on first use only)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


@functools.cache
def _torch_varlen():
    """PyTorch's FlashAttention variable-length kernel (`torch.nn.attention.varlen.varlen_attn`,
    CUDA only) and whether it takes `enable_gqa`, or None where this torch lacks it or its
    `window_size` argument (older releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return (varlen_attn, "enable_gqa" in params) if "window_size" in params else None


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Packed documents' ids [B, S] (`segments`) from their positions, each document counted from 0."""
    return (positions == 0).cumsum(-1)


def _require_half_gpu(q: torch.Tensor) -> None:
    if not _half_on_gpu(q):
        raise RuntimeError(f"attention 'flash' needs fp16 or bf16 on a GPU, got {q.dtype} on {q.device.type}")


def _cu_seqlens(segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document starts over the flattened rows (int32, with the total last) and the
    longest document, as the variable-length kernels take them."""
    b, s = segments.shape
    new = torch.ones_like(segments, dtype=torch.bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = new.flatten().nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen(
    q, k, v, segments: torch.Tensor, window_size: tuple[int, int], scale: float | None
) -> torch.Tensor:
    """FlashAttention over the documents of every row as one ragged batch (no mask, no padding):
    flash-attn's kernel when installed, else PyTorch's."""
    b, s, hq, d = q.shape
    cu, longest = _cu_seqlens(segments)
    q, k, v = (t.reshape(b * s, t.shape[2], d) for t in (q, k, v))
    return _varlen_kernel(q, k, v, cu, cu, longest, longest, window_size, scale).view(b, s, hq, d)


def suffix_documents(q_segments: torch.Tensor, k_segments: torch.Tensor):
    """The variable-length kernels' view of queries that are the last ones of their keys (a chunk
    of a longer row, context parallel) in packed documents: which keys to keep (flat [B * Sk]
    bool: from the chunk's first document on, so every kept document has queries), and the
    cumulative starts of the documents among the queries and among the kept keys (int32, total
    last) with the longest of each. The i-th document is the same on both sides."""
    b = k_segments.shape[0]
    rows = torch.arange(b, device=q_segments.device)[:, None] * (int(k_segments.max()) + 1)
    keep = (k_segments >= q_segments[:, :1]).flatten()
    cu = []
    for ids in ((q_segments + rows).flatten(), (k_segments + rows).flatten()[keep]):
        new = torch.ones_like(ids, dtype=torch.bool)
        new[1:] = ids[1:] != ids[:-1]
        starts = new.nonzero().squeeze(1)
        c = torch.cat([starts, starts.new_tensor([ids.numel()])]).to(torch.int32)
        cu += [c, int((c[1:] - c[:-1]).max())]
    return keep, *cu


def _varlen_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, window_size: tuple[int, int], scale):
    """A FlashAttention variable-length kernel over flat [tokens, heads, D] inputs, causal aligned to
    the bottom right of each document: flash-attn's when installed, else PyTorch's."""
    if _flash_attn_func() is not None:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True, window_size=window_size
        )
    if _torch_varlen() is None:
        raise RuntimeError(
            "attention 'flash' with packed documents or a sliding window needs flash-attn "
            f"(pip install 'megacore[flash]') or a torch with varlen_attn, not {torch.__version__}"
        )
    varlen_attn, takes_gqa = _torch_varlen()
    extra = {} if scale is None else {"scale": scale}
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:  # an older torch: give every query head its own copy of its group's k/v
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(window_size[0], 0), **extra)


def suffix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    impl: Impl = "auto",
    q_segments: torch.Tensor | None = None,
    k_segments: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_attention` for queries q [B, Sq, Hq, D] that are the last Sq positions of the keys
    k/v [B, Sk, Hkv, D] (a late chunk of a row under context parallel): causal aligned to the bottom
    right. `q_segments` [B, Sq] / `k_segments` [B, Sk]: packed documents' ids.

    On a GPU no Sq x Sk mask: flash-attn (bottom-right causal natively, windows too), else the
    variable-length kernel (each row, or each document, a sequence); SDPA's lower-right causal bias
    where there is none. On a CPU SDPA, with a mask only for windows and documents."""
    sq, sk = q.shape[1], k.shape[1]
    windowed = window is not None and sk > window
    window_size = (window - 1, 0) if windowed else (-1, -1)
    if sinks is not None:
        _no_flash_sinks(impl)
        mask = _suffix_mask(sq, sk, window if windowed else None, q_segments, k_segments, q.device)
        return sink_attention(q, k, v, sinks, mask, scale)
    if impl == "flash":
        _require_half_gpu(q)
    on_gpu = impl == "flash" or (impl == "auto" and _half_on_gpu(q))
    if on_gpu and q_segments is None and _flash_attn_func() is not None:
        return _flash_attn_func()(q, k, v, softmax_scale=scale, causal=True, window_size=window_size)
    # Else on a GPU the variable-length kernel, for plain causal rows too: SDPA's lower-right bias
    # takes GQA only on its flash path (the memory-efficient one would materialise a mask).
    if on_gpu and (impl == "flash" or _flash_attn_func() is not None or _torch_varlen() is not None):
        if q_segments is None:  # every row is one document
            q_segments = torch.zeros(q.shape[:2], dtype=torch.long, device=q.device)
            k_segments = torch.zeros(k.shape[:2], dtype=torch.long, device=q.device)
        keep, cu_q, max_q, cu_k, max_k = suffix_documents(q_segments, k_segments)
        b, _, hq, d = q.shape
        kf, vf = (t.reshape(b * sk, t.shape[2], d)[keep] for t in (k, v))
        out = _varlen_kernel(q.reshape(b * sq, hq, d), kf, vf, cu_q, cu_k, max_q, max_k, window_size, scale)
        return out.view(b, sq, hq, d)
    if q_segments is None and not windowed:
        # Imported here: the module pulls in torch._dynamo (2 s on a CPU), which tools that only
        # read or write checkpoints never need.
        from torch.nn.attention.bias import causal_lower_right

        return _sdpa(q, k, v, causal_lower_right(sq, sk), scale)
    mask = _suffix_mask(sq, sk, window if windowed else None, q_segments, k_segments, q.device)
    return _sdpa(q, k, v, mask, scale)


def _suffix_mask(
    sq: int, sk: int, window: int | None, q_segments, k_segments, device: torch.device
) -> torch.Tensor:
    """Boolean [B or 1, 1, Sq, Sk]: causal aligned to the bottom right [, window] [, documents]."""
    qi = torch.arange(sk - sq, sk, device=device)[:, None]
    kj = torch.arange(sk, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask &= kj > qi - window
    mask = mask[None, None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
    return mask


def _no_flash_sinks(impl: Impl) -> None:
    if impl == "flash":  # mega-train refuses it before any worker starts (`run_checks.check_schedule`)
        raise RuntimeError("attention 'flash' has no kernel with attention sinks; use sdpa or auto")


def _sdpa(q, k, v, mask, scale: float | None) -> torch.Tensor:
    """SDPA of [B, S, heads, D] inputs under `mask` (a boolean tensor or an attention bias), through
    transposed views (the kernels take strided inputs: no copies)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=qt.shape[1] != kt.shape[1]
    )
    return out.transpose(1, 2)


def _flash(
    q, k, v, window_size: tuple[int, int], segments: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """A FlashAttention kernel: flash-attn's when installed, else PyTorch's own (SDPA held to its
    flash backend, which takes no window; the variable-length kernel for windows and documents)."""
    _require_half_gpu(q)
    fn = _flash_attn_func()
    if segments is None and fn is not None:
        return fn(q, k, v, softmax_scale=scale, causal=True, window_size=window_size)
    if segments is None and window_size == (-1, -1):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # flash or an error, never another kernel
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
                enable_gqa=k.shape[2] != q.shape[2],
            )  # fmt: skip
        return out.transpose(1, 2)
    if segments is None:  # a window: every row is one document
        segments = torch.arange(q.shape[0], device=q.device)[:, None].expand(q.shape[:2])
    return _varlen(q, k, v, segments, window_size, scale)


def document_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, S, S], True where key j is visible from query i: j <= i in the same document
    (and i - window < j)."""
    s = segments.shape[1]
    ones = torch.ones(s, s, dtype=torch.bool, device=segments.device)
    causal = ones.tril() if window is None else ones.tril().triu(-(window - 1))
    return (segments[:, :, None] == segments[:, None, :]).logical_and_(causal)[:, None]


def flash_usable(q: torch.Tensor) -> bool:
    """flash-attn installed and able to take q (CUDA, half precision)."""
    return _half_on_gpu(q) and _flash_attn_func() is not None


def _half_on_gpu(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


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
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T · scale + causal [+ window] [+ documents]) v for q [B,S,Hq,D], k/v [B,S,Hkv,D];
    returns [B,S,Hq,D]. `segments` [B, S]: each token's document id (packed documents). `scale`:
    None for 1 / sqrt(D) (every kernel's default; Gemma's is query_pre_attn_scalar ** -0.5).
    `sinks` [Hq]: each head's sink logit in the softmax's denominator (`models.sinks`)."""
    seq_len = q.shape[1]
    windowed = window is not None and seq_len > window
    window_size = (window - 1, 0) if windowed else (-1, -1)
    if sinks is not None:
        _no_flash_sinks(impl)
        rows = q.new_zeros(1, seq_len, dtype=torch.long) if segments is None else segments
        return sink_attention(q, k, v, sinks, document_mask(rows, window if windowed else None), scale)
    if impl == "flash" or (impl == "auto" and flash_usable(q)):
        return _flash(q, k, v, window_size, segments, scale)
    if segments is not None and impl == "auto" and _half_on_gpu(q) and _torch_varlen() is not None:
        return _varlen(q, k, v, segments, window_size, scale)  # no S x S mask, no slow masked kernel
    if segments is not None:
        return _sdpa(q, k, v, document_mask(segments, window if windowed else None), scale)
    if windowed:
        return _sdpa(q, k, v, _window_mask(seq_len, window, q.device), scale)
    # SDPA wants [B, heads, S, D]; transposed views avoid copies (the kernels take strided inputs).
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
