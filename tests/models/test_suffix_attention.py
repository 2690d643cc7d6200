"""Attention of queries that are the last positions of their keys (a late chunk of a row under
context parallel, `suffix_attention`) against the whole row's causal attention, whose last rows
it must reproduce: plain causal, a sliding window, packed documents; and the documents' bookkeeping
for the variable-length GPU kernels (`suffix_documents`), consumed here by one SDPA call per
document, against the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacore.models.attention import causal_attention, suffix_attention, suffix_documents

B, S, HQ, HKV, D = 2, 24, 4, 2, 8
SEGMENTS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [0] * 17 + [1] * 7])  # documents per row


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, S, HQ, D, generator=g), *(torch.randn(B, S, HKV, D, generator=g) for _ in range(2))


@pytest.mark.parametrize("sq", [6, 12, 24])
@pytest.mark.parametrize("case", ["causal", "window", "documents", "documents+window"])
def test_the_last_queries_see_what_they_see_in_the_whole_row(case: str, sq: int) -> None:
    q, k, v = qkv()
    window = 5 if "window" in case else None
    segments = SEGMENTS if "documents" in case else None
    whole = causal_attention(q, k, v, window, "sdpa", segments, scale=0.3)[:, -sq:]
    seg_q = None if segments is None else segments[:, -sq:]
    got = suffix_attention(q[:, -sq:], k, v, window, "sdpa", seg_q, segments, scale=0.3)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


def test_document_bookkeeping_for_the_variable_length_kernels() -> None:
    """Each document of the chunk's queries against its kept keys, bottom-right causal: the whole
    row's result. Row 0's chunk (the last 12 tokens) starts inside document 1, so its document 0 is
    dropped from the keys; row 1's starts in document 0, whose earlier keys stay."""
    q, k, v = qkv()
    sq = 12
    keep, cu_q, max_q, cu_k, max_k = suffix_documents(SEGMENTS[:, -sq:], SEGMENTS)
    assert cu_q.tolist() == [0, 2, 12, 17, 24] and cu_k.tolist() == [0, 9, 19, 36, 43]
    assert (max_q, max_k) == (10, 17) and int(keep.sum()) == 43
    qf = q[:, -sq:].reshape(B * sq, HQ, D)
    kf, vf = (t.reshape(B * S, HKV, D)[keep] for t in (k, v))
    parts = []
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qt, kt, vt = qf[a:b].transpose(0, 1), kf[c:d].transpose(0, 1), vf[c:d].transpose(0, 1)
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))  # bottom right
        parts.append(
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        )
    got = torch.cat(parts).view(B, sq, HQ, D)
    whole = causal_attention(q, k, v, None, "sdpa", SEGMENTS)[:, -sq:]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)
