"""The GPU paths, run where CUDA is present (skipped elsewhere): the decoder's logits on CUDA against
transformers, bf16 training step (FlashAttention 2 when installed, else SDPA) against fp32, and the
fused loss without the CPU scratch buffers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hf_cases import build, load_hf, tokens
from megacore.models import Decoder, config_from_hf, hf_state_dict_to_ours
from megacore.models.loss import fused_linear_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ours(path: Path) -> Decoder:
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), pad_multiple=64)
    model = Decoder(cfg)
    model.load_state_dict(hf_state_dict_to_ours(cfg, load_file(path / "model.safetensors")))
    return model


@pytest.mark.parametrize(
    "case", ["llama2-70b-gqa", "mistral-window", "falcon-40b", "qwen2-window", "qwen3", "gemma3", "mixtral"]
)
def test_cuda_logits_match_transformers(case: str, tmp_path: Path) -> None:
    path = build(case, tmp_path / case)
    hf = load_hf(path).cuda()
    ours = _ours(path).cuda().eval()
    ids = tokens(hf.config.vocab_size, 32).cuda()
    with torch.no_grad():
        err = (ours(ids)[..., : hf.config.vocab_size] - hf(ids).logits).abs().max().item()
    assert err < 1e-3, err  # TF32 may be on for CUDA matmuls


def test_cuda_bf16_step_close_to_fp32(tmp_path: Path) -> None:
    """One bf16 training step (flash-attn when installed) against fp32 on the same weights: the
    loss within 2% and the gradients within 5% (norm-wise)."""
    path = build("llama2-70b-gqa", tmp_path / "m")
    ref = _ours(path).cuda().train()
    low = copy.deepcopy(ref).to(torch.bfloat16)
    ids = tokens(ref.config.vocab_size, 64).cuda()
    x, y = ids[:, :-1], ids[:, 1:]
    losses = []
    for model in (ref, low):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0], losses
    for (name, p), q in zip(ref.named_parameters(), low.parameters(), strict=True):
        err = (q.grad.float() - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert err < 5e-2, (name, err.item())


def test_cuda_fused_loss_matches_unfused() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g).cuda().requires_grad_()
    w = (torch.randn(256, 64, generator=g) * 0.1).cuda().requires_grad_()
    t = torch.randint(0, 250, (300,), generator=g).cuda()
    loss = fused_linear_cross_entropy(h, w, t, 250)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.T)[:, :250].float(), t)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-4
    assert (gh - h.grad).abs().max() < 1e-4 and (gw - w.grad).abs().max() < 1e-4


def test_cuda_packed_documents_match_each_alone() -> None:
    """Packed documents in bf16 on the GPU (FlashAttention's variable-length kernel when installed,
    else SDPA with the block-causal mask): each document's logits as when it runs alone, within bf16
    rounding (2% norm-wise)."""
    from megacore.config import ModelConfig

    cfg = ModelConfig(
        family="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=128, max_seq_len=64,
    )  # fmt: skip
    model = Decoder(cfg)
    model.init_weights(std=0.2, seed=0)
    model = model.cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 10]
    docs = [torch.randint(0, 128, (n,), generator=g).cuda() for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], positions=positions)[0].float()
        start = 0
        for d in docs:
            alone = model(d[None])[0].float()
            part = packed[start : start + len(d)]
            assert (part - alone).norm() < 2e-2 * alone.norm(), len(d)
            start += len(d)


@pytest.mark.parametrize("scale", [None, 0.1], ids=["default-scale", "scale-0.1"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("impl", ["flash", "auto"])
def test_cuda_flash_kernels_match_sdpa_in_fp32(impl: str, packed: bool, window: int | None, scale) -> None:
    """`flash` (flash-attn, else PyTorch's FlashAttention: SDPA's flash backend, the variable-length
    kernel for windows and packed documents) and `auto` in bf16 against SDPA's masked fp32 result,
    with GQA and with a score scale of its own (Gemma's): outputs and input gradients within bf16
    rounding (2% norm-wise)."""
    from megacore.models.attention import causal_attention

    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 64, 8, 2, 64
    q, k, v = (torch.randn(b, s, h, d, generator=g).cuda() for h in (hq, hkv, hkv))
    segments = torch.tensor([0] * 20 + [1] * 30 + [2] * 14).cuda().expand(b, s) if packed else None
    outs, grads = [], []
    for dtype, kind in ((torch.float32, "sdpa"), (torch.bfloat16, impl)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = causal_attention(*leaves, window=window, impl=kind, segments=segments, scale=scale)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in leaves])
    assert (outs[1] - outs[0]).norm() < 2e-2 * outs[0].norm()
    for got, want in zip(grads[1], grads[0], strict=True):
        assert (got - want).norm() < 2e-2 * want.norm()


@pytest.mark.parametrize("case", ["causal", "window", "documents"])
def test_cuda_late_chunk_attention_matches_the_whole_row(case: str) -> None:
    """Context parallel's late chunk on the GPU kernels (flash-attn or SDPA's lower-right causal
    bias; the variable-length kernels for windows and documents, no mask), bf16, forward and
    backward, against the whole row's attention in fp32 on the CPU."""
    from megacore.models.attention import causal_attention, suffix_attention

    g = torch.Generator().manual_seed(0)
    b, s, sq = 2, 256, 64
    q, k, v = (torch.randn(b, s, h, 64, generator=g) for h in (8, 2, 2))
    segments = torch.tensor([[0] * 100 + [1] * 156, [0] * 220 + [1] * 36]) if case == "documents" else None
    window = 96 if case == "window" else None
    want = causal_attention(q, k, v, window, "sdpa", segments)[:, -sq:]
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (q[:, -sq:], k, v)]
    seg_q, seg_k = (None, None) if segments is None else (segments[:, -sq:].cuda(), segments.cuda())
    got = suffix_attention(*leaves, window, "auto", seg_q, seg_k)
    got.float().square().sum().backward()
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 2e-2, err.item()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_grouped_matmul_experts_match_the_loop() -> None:
    """bf16 on a GPU, the experts run through `torch._grouped_mm`: outputs and the gradients of the
    rows and of every expert's weights against the per-expert loop in fp32 (an expert without rows
    included), within bf16's rounding."""
    from megacore.models.moe import grouped_swiglu

    g = torch.Generator().manual_seed(0)
    experts, hidden, ffn = 4, 64, 128
    counts = torch.tensor([5, 0, 17, 10])
    x = torch.randn(int(counts.sum()), hidden, generator=g)
    weights = [
        torch.randn(experts, *s, generator=g) * 0.1 for s in ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    ]
    dy = torch.randn(x.shape[0], hidden, generator=g)

    def run(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, *weights)]
        out = grouped_swiglu(leaves[0], counts.to(device), *leaves[1:])
        out.backward(dy.to(device, dtype))
        return [out.float().cpu()] + [t.grad.float().cpu() for t in leaves]

    for got, want in zip(run("cuda", torch.bfloat16), run("cpu", torch.float32), strict=True):
        assert (got - want).norm() <= 2e-2 * want.norm().clamp_min(1e-6), (got - want).norm() / want.norm()
