"""The output projection fused with cross entropy (megacore.models.loss) against the unfused
`F.cross_entropy(logits.float(), targets)`: one chunk and several, fp32 and bf16, padded vocab, a
scaled loss, and scratch buffers reused between calls of different sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacore.models import loss as loss_mod
from megacore.models.loss import fused_linear_cross_entropy


def _case(n: int, hidden: int, vocab: int, padded: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(padded, hidden, generator=g) * 0.5).to(dtype)
    w[vocab:] = 0
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


def _both(h, w, t, vocab: int, scale: float = 1.0):
    """(loss, grad_h, grad_w) fused and unfused, as fp32."""
    out = []
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = fused_linear_cross_entropy(hh, ww, t, vocab)
        else:
            loss = F.cross_entropy((hh @ ww.T)[:, :vocab].float(), t)
        (loss * scale).backward()
        out.append((loss.float(), hh.grad.float(), ww.grad.float()))
    return out


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700], ids=["one-chunk", "many-chunks"])
def test_fp32_matches_unfused(chunk_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", chunk_elements)  # 700 // 96 = 7 rows a chunk
    h, w, t = _case(40, 16, 90, 96, torch.float32, 0)
    (loss, gh, gw), (loss_ref, gh_ref, gw_ref) = _both(h, w, t, 90, scale=3.0)
    assert abs(loss - loss_ref) < 1e-5
    assert (gh - gh_ref).abs().max() < 1e-6
    assert (gw - gw_ref).abs().max() < 1e-6
    assert torch.all(gw[90:] == 0), "padded vocab rows got gradient"


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700], ids=["one-chunk", "many-chunks"])
def test_bf16_within_rounding_of_unfused(chunk_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs: fp32 softmax, gradients rounded once to bf16 (the weight gradient summed over
    chunks in fp32), so both sides differ by about one bf16 rounding (2^-8 relative)."""
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", chunk_elements)
    h, w, t = _case(40, 16, 90, 96, torch.bfloat16, 1)
    (loss, gh, gw), (loss_ref, gh_ref, gw_ref) = _both(h, w, t, 90)
    assert abs(loss - loss_ref) < 1e-3 * abs(loss_ref)
    exact = _both(h.double(), w.double(), t, 90)[1]
    for got, ref, want in ((gh, gh_ref, exact[1]), (gw, gw_ref, exact[2])):
        err, err_ref = (got - want).norm() / want.norm(), (ref - want).norm() / want.norm()
        assert err < max(2 * err_ref, 2**-8), (err, err_ref)


def test_scratch_reuse_across_sizes() -> None:
    """A smaller call after a bigger one reuses the bigger call's scratch: no stale values leak."""
    big = _case(64, 16, 90, 96, torch.float32, 2)
    small = _case(8, 16, 90, 96, torch.float32, 3)
    for h, w, t in (big, small, big):
        (loss, gh, gw), (loss_ref, gh_ref, gw_ref) = _both(h, w, t, 90)
        assert abs(loss - loss_ref) < 1e-5 and (gh - gh_ref).abs().max() < 1e-6
        assert (gw - gw_ref).abs().max() < 1e-6


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_targets_count_for_nothing(chunk_elements: int, reduction: str, monkeypatch) -> None:
    """Targets equal to IGNORE (not assistant tokens, document boundaries) as F.cross_entropy's
    ignore_index: mean over the others, or their sum; a mean over none is 0 with zero gradients."""
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", chunk_elements)
    h, w, t = _case(40, 16, 90, 96, torch.float32, 2)
    t[::3] = loss_mod.IGNORE
    t[20:30] = loss_mod.IGNORE  # a whole chunk ignored when 7 rows make a chunk
    out = []
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = fused_linear_cross_entropy(hh, ww, t, 90, reduction=reduction)
        else:
            loss = F.cross_entropy((hh @ ww.T)[:, :90], t, reduction=reduction)
        (loss * 2.0).backward()
        out.append((loss, hh.grad, ww.grad))
    (loss, gh, gw), (loss_ref, gh_ref, gw_ref) = out
    assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref)
    assert (gh - gh_ref).abs().max() < 1e-6 and (gw - gw_ref).abs().max() < 1e-6
    assert torch.all(gh[t == loss_mod.IGNORE] == 0)

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    none = fused_linear_cross_entropy(hh, ww, torch.full_like(t, loss_mod.IGNORE), 90)
    none.backward()
    assert none.item() == 0 and not hh.grad.any() and not ww.grad.any()


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700], ids=["one-chunk", "many-chunks"])
def test_evaluation_computes_the_loss_alone(chunk_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autograd (evaluation) the loss equals the unfused one, ignored targets included, and
    no gradient matmul runs: the profiler sees one matmul per chunk (the logits), none of the two
    `addmm`s per chunk a training step makes."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", chunk_elements)
    h, w, t = _case(40, 96, 90, 100, torch.float32, seed=5)
    t[::3] = loss_mod.IGNORE
    keep = t != loss_mod.IGNORE
    want = F.cross_entropy((h @ w.T)[:, :90][keep], t[keep])
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

    def ops(grad: bool) -> tuple[torch.Tensor, list[str]]:
        with torch.set_grad_enabled(grad), profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = fused_linear_cross_entropy(hh, ww, t, 90)
        return loss, [e.name for e in prof.events()]

    loss, names = ops(False)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert names.count("aten::addmm") == 0 and names.count("aten::mm") >= 1, sorted(set(names))
    _, train_names = ops(True)  # the same call with autograd does make them: the count means something
    assert train_names.count("aten::addmm") >= 2


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700], ids=["one-chunk", "many-chunks"])
def test_a_frozen_output_layer_gets_no_gradient_matmul(chunk_elements: int, monkeypatch) -> None:
    """LoRA's frozen head: the input's gradient is the unfused one's, the weight gets none, and each
    chunk makes one `addmm` (the input's), not two."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", chunk_elements)
    h, w, t = _case(40, 16, 90, 96, torch.float32, 4)
    chunks = -(-40 // min(40, chunk_elements // 96))
    (_, gh_ref, _), _ = _both(h, w, t, 90)
    hh = h.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = fused_linear_cross_entropy(hh, w, t, 90)
    loss.backward()
    torch.testing.assert_close(hh.grad, gh_ref, rtol=1e-5, atol=1e-7)
    assert not w.requires_grad and w.grad is None
    assert [e.name for e in prof.events()].count("aten::addmm") == chunks
