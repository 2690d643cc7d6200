"""gpt-oss against transformers' GptOssForCausalLM (logits and every gradient, fp32), and the sink
kernel (`models/sinks.py`) against the softmax with the sink column written out here: forward and
backward, GQA, sliding windows, packed documents, queries at the end of their keys (context
parallel's chunks), bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hf_cases import CASES, build, load_hf, tokens
from megacore.models import Decoder, config_from_hf, export_tensors, hf_state_dict_to_ours
from megacore.models.attention import causal_attention, suffix_attention
from megacore.models.sinks import _math_sink_attention


def test_gpt_oss_logits_and_every_gradient_match_transformers(tmp_path: Path) -> None:
    """hf_cases' gpt-oss (a sliding and a full layer, sinks, biases everywhere, the clamped SwiGLU
    with a limit that binds, YaRN): logits and every gradient equal transformers' (eager, its only
    path with sinks), fp32, < 1e-4 up to magnitude 1; the gradients compared under the checkpoint's
    names, through export's fused, interleaved gate_up layout."""
    path = build("gpt-oss", tmp_path / "hf")
    hf = load_hf(path).train()
    cfg = config_from_hf(hf.config)
    assert (
        cfg.attention.sinks
        and cfg.mlp_bias
        and cfg.activation == "clamped_swiglu"
        and cfg.swiglu_limit == 0.3
    )
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 8
    ours = Decoder(cfg)
    ours.load_state_dict(hf_state_dict_to_ours(cfg, load_file(path / "model.safetensors")))
    ids = tokens(cfg.vocab_size, CASES["gpt-oss"][2] + 1)
    x, y = ids[:, :-1], ids[:, 1:]
    out = hf(x)
    F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).backward()
    logits = ours(x)
    assert (logits - out.logits).abs().max() < 1e-4
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    got = dict(export_tensors(cfg, grads.__getitem__))
    ref = {n: p.grad for n, p in hf.named_parameters()}
    assert sorted(got) == sorted(ref)
    for name, g in ref.items():
        err = (got[name] - g).abs().max().item()
        assert err < 1e-4 * max(1.0, g.abs().max().item()), (name, err)
    # the sinks and the clamp were live: their gradients are not all zero
    assert ref["model.layers.0.self_attn.sinks"].abs().min() > 0


def _reference(q, k, v, sinks, visible, scale):
    """The formula: per head, softmax over [q·k * scale where visible, the sink] without the sink's
    column, times v (k/v repeated for GQA), in fp64."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ v).transpose(1, 2)


def _inputs(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (hq,))
    return [
        torch.randn(s, generator=g).mul(2.0 if len(s) == 1 else 1.0).to(dtype).requires_grad_()
        for s in shapes
    ]


def _visible(sq: int, sk: int, window: int | None, q_docs=None, k_docs=None) -> torch.Tensor:
    """Worked out here: key j visible from query i (at position sk - sq + i) when j <= its position,
    within the window, and in the same document."""
    pos = torch.arange(sk - sq, sk)[:, None]
    j = torch.arange(sk)[None, :]
    ok = j <= pos
    if window is not None:
        ok = ok & (j > pos - window)
    ok = ok[None, None]
    if q_docs is not None:
        ok = ok & (q_docs[:, :, None] == k_docs[:, None, :])[:, None]
    return ok


CASES_KERNEL = {
    "causal": (12, 12, None, False),
    "window": (12, 12, 4, False),
    "documents": (12, 12, None, True),
    "window+documents": (12, 12, 5, True),
    "suffix": (6, 14, None, False),
    "suffix+window+documents": (6, 14, 4, True),
}


CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("path", ["kernel", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES_KERNEL))
def test_sink_kernel_forward_and_backward_equal_the_formula(
    case: str, dtype: torch.dtype, path: str, device: str
) -> None:
    """The CPU kernel (FlashAttention for CPU and the sinks' rescale, a hand-written backward) and
    the math path other devices take (on the CPU too), each against `_reference` on the CPU in
    fp64: output and the gradients of q, k, v and the sinks; fp32 within 2e-5, bf16
    within bf16's rounding of the inputs' scale. On a GPU, where one is: its path, both calls."""
    sq, sk, window, docs = CASES_KERNEL[case]
    q, k, v, sinks = (t.detach().to(device).requires_grad_() for t in _inputs(2, sq, sk, 4, 2, 16, dtype))
    scale = 0.3
    k_docs = q_docs = None
    if docs:
        k_docs = torch.tensor([[0] * 5 + [1] * (sk - 5), [0] * (sk - 3) + [1] * 3])
        q_docs = k_docs[:, sk - sq :]
    visible = _visible(sq, sk, window, q_docs, k_docs).to(device)
    k_docs, q_docs = (None if t is None else t.to(device) for t in (k_docs, q_docs))
    if path == "math":  # what a GPU runs, here on the CPU
        out = _math_sink_attention(q, k, v, sinks, visible, scale)
    elif sq == sk:
        out = causal_attention(q, k, v, window, "sdpa", q_docs, scale, sinks)
    else:
        out = suffix_attention(q, k, v, window, "sdpa", q_docs, k_docs, scale, sinks)
    ref = _reference(q, k, v, sinks, visible, scale)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max() < tol
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    want = torch.autograd.grad(ref, (q, k, v, sinks), grad.double())
    for name, a, b in zip(["q", "k", "v", "sinks"], got, want, strict=True):
        err = (a.double() - b).abs().max().item()
        assert err < tol * max(1.0, b.abs().max().item()), (name, err)
