"""The gated delta rule's PyTorch path (`megacore.models.delta_rule`, chunked, its backward a
recompute) against the recurrence of the Gated DeltaNet paper written out token by token here, in
fp64 (1e-10): outputs, final states and every input's gradient, over several chunks, with value
heads sharing key heads, packed documents whose boundaries fall inside and between chunks, and a
state carried in (what generation continues from). The model's layer against transformers:
tests/families (Qwen 3.5's row) and test_packing.py."""

from __future__ import annotations

import pytest
import torch

from megacore.models.delta_rule import gated_delta_rule

TOL = 1e-10


def recurrence(q, k, v, g, beta, docs, state=None):
    """S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t per head, with q
    and k L2-normalised (eps 1e-6 inside the root), q times dk^-1/2, S zero at each document's start
    (a carried-in state belongs to the row's first document)."""
    b, s, hv, dv = v.shape
    group = hv // k.shape[2]
    out = torch.zeros_like(v)
    finals = []
    for row in range(b):
        st = torch.zeros(hv, k.shape[-1], dv, dtype=v.dtype) if state is None else state[row].clone()
        for t in range(s):
            if t > 0 and docs[row, t] != docs[row, t - 1]:
                st = torch.zeros_like(st)
            for h in range(hv):
                qt, kt = q[row, t, h // group], k[row, t, h // group]
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) / qt.shape[0] ** 0.5
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                eye = torch.eye(kt.shape[0], dtype=v.dtype)
                bt = beta[row, t, h]
                st_h = torch.exp(g[row, t, h]) * (eye - bt * torch.outer(kt, kt)) @ st[h]
                st_h = st_h + bt * torch.outer(kt, v[row, t, h])
                st = torch.cat([st[:h], st_h[None], st[h + 1 :]])
                out[row, t, h] = st_h.T @ qt
        finals.append(st)
    return out, torch.stack(finals)


def inputs(b: int, s: int, hk: int = 2, hv: int = 4, dk: int = 6, dv: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return (
        rand(b, s, hk, dk),
        rand(b, s, hk, dk),
        rand(b, s, hv, dv),
        -torch.rand(b, s, hv, generator=g, dtype=torch.float64),
        torch.rand(b, s, hv, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_chunked_rule_is_the_recurrence(packed: bool) -> None:
    """Three chunks of 8 and 3 padded tokens; packed: boundaries at 5 (inside the first chunk),
    8 (a chunk's start) and 19, and a row of one document."""
    q, k, v, g, beta = (t.requires_grad_() for t in inputs(2, 19 + 2))
    docs = torch.zeros(2, 21, dtype=torch.long)
    if packed:
        docs[0, 5:], docs[0, 8:], docs[0, 19:] = 1, 2, 3
    out, state = gated_delta_rule(q, k, v, g, beta, docs if packed else None, chunk=8)
    ref, ref_state = recurrence(q, k, v, g, beta, docs)
    assert (out - ref).abs().max() < TOL and (state - ref_state).abs().max() < TOL
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ours = torch.autograd.grad((out * w).sum() + state.sum(), (q, k, v, g, beta))
    theirs = torch.autograd.grad((ref * w).sum() + ref_state.sum(), (q, k, v, g, beta))
    for name, a, b in zip(["q", "k", "v", "g", "beta"], ours, theirs, strict=True):
        assert (a - b).abs().max() < TOL, name


def test_a_state_carried_in_continues_the_row() -> None:
    """The state after the first 13 tokens, carried into the rest, gives the whole row's outputs,
    as generation continues a prompt."""
    q, k, v, g, beta = inputs(2, 20, seed=4)
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, chunk=8)
    head, state = gated_delta_rule(q[:, :13], k[:, :13], v[:, :13], g[:, :13], beta[:, :13], chunk=8)
    rest, end = gated_delta_rule(
        q[:, 13:], k[:, 13:], v[:, 13:], g[:, 13:], beta[:, 13:], state=state, chunk=8
    )
    assert (torch.cat([head, rest], 1) - whole).abs().max() < TOL
    assert (end - whole_state).abs().max() < TOL
