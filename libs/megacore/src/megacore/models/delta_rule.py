"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen 3.5's and Qwen3-Next's linear
attention), in PyTorch, chunked, with the recurrence reset at each packed document's start.

Per head, a state S (dk x dv) is read by each query and updated by each token t:

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

(g_t <= 0 the log decay, b_t in (0, 1) the write strength; q and k L2-normalised, q times
dk^-1/2, as transformers and flash-linear-attention do). A token that starts a document starts
from S = 0.

Chunked form, chunks of C tokens entered with state S_0 and cumulative log decays G_i inside the
chunk: the delta corrections of a chunk's tokens on each other solve one unit lower triangular
system, u = (I + A)^-1 (b v - b exp(G) k S_0), A_ij = b_i exp(G_i - G_j) k_i.k_j for j < i; then
o_i = exp(G_i) q_i S_0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j and the state leaving is
exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T. Documents: pairs across a document boundary are
masked out of A and of the sums, S_0 reaches only the positions still in the document it carries,
and the state leaving keeps only the last document's part. Every exponent is of a sum of g <= 0
over a span, so nothing overflows. Only the scan over chunks is sequential (seq / C steps).

`gated_delta_rule` saves only its inputs for backward and recomputes the chunked forward there
(autograd through it): the intra-chunk C x C matrices of every chunk are never kept, as a
FlashAttention kernel keeps no score matrix. Everything is computed in fp32 (transformers' torch
path does the same) and returned in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and flash-linear-attention's chunk size
L2_EPS = 1e-6  # the q/k L2 norm's epsilon (transformers' l2norm, flash-linear-attention's)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as the kernels normalise q and k."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, Hk, dk], v [B, S, Hv, dv] (Hv a multiple of Hk: each k head serves Hv / Hk
    consecutive v heads), g and beta [B, S, Hv]; `segments` [B, S] each token's document id
    (non-decreasing along a row; None: one document); `state` [B, Hv, dk, dv] the state before the
    first token, carried by its document (None: zeros). Returns the output [B, S, Hv, dv] in v's
    dtype and the final state [B, Hv, dk, dv] in fp32 (the state after the row's last token; fp64
    inputs are computed, and their state kept, in fp64)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        return _Recomputed.apply(q, k, v, g, beta, segments, state, chunk)
    return _chunked(q, k, v, g, beta, segments, state, chunk)


class _Recomputed(torch.autograd.Function):
    """The chunked rule saving its inputs alone, its forward run again with autograd in backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, segments, state, chunk):
        ctx.save_for_backward(q, k, v, g, beta, segments, state)
        ctx.chunk = chunk
        with torch.no_grad():
            return _chunked(q, k, v, g, beta, segments, state, chunk)

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in saved]
        q, k, v, g, beta, segments, state = inputs
        wanted = [t for t in (q, k, v, g, beta, state) if t is not None and t.requires_grad]
        with torch.enable_grad():
            out, final = _chunked(q, k, v, g, beta, segments, state, ctx.chunk)
            grads = torch.autograd.grad((out, final), wanted, (grad_out, grad_state), allow_unused=True)
        found = dict(zip(map(id, wanted), grads, strict=True))
        pick = [found.get(id(t)) if t is not None else None for t in (q, k, v, g, beta)]
        return (*pick, None, found.get(id(state)) if state is not None else None, None)


def _chunked(q, k, v, g, beta, segments, state, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, hv, dv = v.shape
    group = hv // k.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    work = torch.promote_types(v.dtype, torch.float32)  # fp32 at least (fp64 stays fp64: the tests')
    q, k = l2_normalize(q.to(work)), l2_normalize(k.to(work))
    q = q * q.shape[-1] ** -0.5
    docs = torch.zeros(b, s, dtype=torch.long, device=v.device) if segments is None else segments
    pad = -s % chunk
    # [B, H, N, C, ...]: heads first, the sequence cut into N chunks of C (padded at the end with
    # tokens that write and decay nothing, in the last document)
    q, k, vf = (_chunks(F.pad(t.transpose(1, 2), (0, 0, 0, pad)), chunk) for t in (q, k, v.to(work)))
    g, beta = (_chunks(F.pad(t.to(work).transpose(1, 2), (0, pad)), chunk) for t in (g, beta))
    docs = F.pad(docs, (0, pad), mode="replicate") if pad else docs
    same, carried, last = _document_masks(docs.view(b, 1, -1, chunk), state is not None)
    carried, last = carried.to(work), last.to(work)
    cum = g.cumsum(-1)  # G_i, from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    visible = same & causal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~visible, float("-inf")).exp()
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # A below the diagonal; its diagonal is ignored
    values = torch.linalg.solve_triangular(system, vf * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(
        system, kb * (cum.exp() * carried)[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_in = q * (cum.exp() * carried)[..., None]  # queries reading the entering state
    k_out = k * ((cum[..., -1:] - cum).exp() * last)[..., None]  # keys written to the leaving state
    keep = (cum[..., -1].exp() * carried[..., -1])[..., None, None]
    st = torch.zeros(b, hv, k.shape[-1], dv, dtype=work, device=v.device) if state is None else state.to(work)
    outs = []
    # unbound once: indexing a chunk in the loop would make backward fill a zero tensor of the
    # whole sequence per chunk and tensor (select's gradient), unbind's stacks the chunks' once
    chunks = zip(*(t.unbind(2) for t in (values, reads, q_in, intra, k_out, keep)), strict=True)
    for values_n, reads_n, q_n, intra_n, k_n, keep_n in chunks:
        u = values_n - reads_n @ st
        outs.append(q_n @ st + intra_n @ u)
        st = st * keep_n + k_n.transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :s]
    return out.transpose(1, 2).to(v.dtype), st


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, H, S, ...] -> [B, H, S / chunk, chunk, ...]."""
    return x.unflatten(2, (x.shape[2] // chunk, chunk))


def _document_masks(docs: torch.Tensor, initial: bool) -> tuple[torch.Tensor, ...]:
    """From document ids [B, 1, N, C]: pairs in the same document [B, 1, N, C, C]; positions that
    the state entering their chunk reaches [B, 1, N, C] (in the document of the chunk before's last
    token; the first chunk's, only with an initial state, in the row's first document); positions
    in their chunk's last document, which the state leaving it keeps [B, 1, N, C]."""
    same = docs[..., :, None] == docs[..., None, :]
    before = torch.cat([docs[..., :1, :1] if initial else docs[..., :1, :1] - 1, docs[..., :-1, -1:]], dim=2)
    carried = docs == before
    last = docs == docs[..., -1:]
    return same, carried, last
