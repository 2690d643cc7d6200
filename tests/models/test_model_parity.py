"""megacore's Decoder against transformers (SDPA) on tiny random models of every family/variant:
max absolute fp32 logit error below 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_bitwise_equal
from hf_cases import CASES, build, load_hf, ours_from_dir, tokens
from megacore.config import ModelConfig
from megacore.models import Decoder, config_from_hf, export_tensors
from megacore.models.hf import VOCAB_TENSORS

TOL = 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = build(case, tmp_path / case)
    hf = load_hf(path)
    ours = ours_from_dir(path, pad_multiple=64)
    vocab = hf.config.vocab_size
    ids = tokens(vocab, CASES[case][2])
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape[-1] % 64 == 0 and got.shape[-1] >= vocab
    assert torch.all(got[..., vocab:] == 0), "padded vocab rows must give zero logits"
    err = (got[..., :vocab] - ref).abs().max().item()
    assert ref.abs().max().item() > 0.5, "test model too weak to detect errors"
    assert err < TOL, f"{case}: max abs logit error {err:.3g}"


def test_sliding_window_applies_only_beyond_window(tmp_path: Path) -> None:
    path = build("mistral-window", tmp_path / "m")  # window 8
    ours = ours_from_dir(path)
    hf = load_hf(path)
    unwindowed = Decoder(ours.config.__class__(**{**_fields(ours.config), "sliding_window": None}))
    unwindowed.load_state_dict(ours.state_dict())
    short, long = tokens(128, 8), tokens(128, 20)
    with torch.no_grad():
        # seq == window: the window hides nothing, identical to full causal attention
        assert_bitwise_equal(ours(short), unwindowed(short), "seq == window")
        # seq > window: later positions differ, and match transformers' windowed model
        windowed, full = ours(long), unwindowed(long)
        assert_bitwise_equal(windowed[:, :8], full[:, :8], "positions within the window")
        assert (windowed[:, 8:] - full[:, 8:]).abs().max() > 1e-3
        assert (ours(long) - hf(long).logits).abs().max() < TOL


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__struct_fields__}


def test_classic_and_v5_config_forms_agree(tmp_path: Path) -> None:
    """A published-style config.json (top-level rope_theta + rope_scaling) parses to the same
    ModelConfig, and transformers loads that classic file into the same logits we compute."""
    path = build("llama3.1", tmp_path / "v5")
    v5 = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in v5
    classic = {k: v for k, v in v5.items() if k != "rope_parameters"}
    params = dict(v5["rope_parameters"])
    classic["rope_theta"] = params.pop("rope_theta")
    classic["rope_scaling"] = params
    assert config_from_hf(classic) == config_from_hf(v5)
    (path / "config.json").write_text(json.dumps(classic))
    hf = load_hf(path)
    ids = tokens(128256, 16)
    with torch.no_grad():
        assert (ours_from_dir(path)(ids) - hf(ids).logits).abs().max() < TOL


def _grads_vs_transformers(case: str, tmp_path: Path, fused: bool, compile: bool = False) -> None:
    path = build(case, tmp_path / "g")
    hf, ours = load_hf(path).train(), ours_from_dir(path, pad_multiple=64).train()
    if compile:
        ours.compile_blocks()
    vocab = hf.config.vocab_size
    ids = tokens(vocab, 16)
    x, y = ids[:, :-1], ids[:, 1:]
    loss_ref = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
    loss = (
        ours(x, y)
        if fused
        else torch.nn.functional.cross_entropy(ours(x)[..., :vocab].flatten(0, 1), y.flatten())
    )
    loss_ref.backward()
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) < 1e-5
    cfg = ours.config
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert None not in grads.values(), [n for n, g in grads.items() if g is None]
    for name in VOCAB_TENSORS:
        if name in grads:  # (no padded rows where the vocab is already a multiple of 64)
            assert torch.all(grads[name][vocab:] == 0), f"{name}: padded vocab rows got gradient"
    # Our gradients under Hugging Face names, through the family's tensor maps (Falcon's fused
    # query_key_value reassembled from q/k/v, padded vocab rows dropped), against every gradient of
    # the transformers model: biases, norms and tied embeddings included.
    got = dict(export_tensors(cfg, grads.__getitem__))
    ref = {n: p.grad for n, p in hf.named_parameters()}
    assert sorted(got) == sorted(ref)
    for name, g in ref.items():
        assert g is not None and g.abs().max() > 0, f"{name}: transformers computed no gradient"
        assert got[name].shape == g.shape, (name, got[name].shape, g.shape)
        # fp32 rounding grows with the gradient's size: absolute 1e-5 up to magnitude 1, relative
        # beyond. Gemma 3's embedding gradient (through its sqrt(hidden) scale: max 2.3) is 1.2e-5
        # from transformers', less than transformers' own fp32 gradient is from an fp64 one (1.6e-5).
        err = (got[name] - g).abs().max().item()
        bound = 1e-5 * max(1.0, g.abs().max().item())
        assert err < bound, f"{case}: {name}: max abs gradient error {err:.3g} (bound {bound:.3g})"


GRAD_CASES = ["llama", "llama2-70b-gqa", "llama-bias-tied", "mistral-window", "falcon-7b", "falcon-40b",
              "falcon-sequential-bias", "qwen2", "qwen2.5-tied", "qwen2-window", "qwen3", "llama3.2",
              "gemma3"]  # fmt: skip


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-loss"])
def test_gradients_match_transformers(case: str, fused: bool, tmp_path: Path) -> None:
    """Training needs the backward pass too: loss and every gradient of the transformers model agree
    with ours, whether the loss is taken from the logits or fused with the output projection
    (`model(x, targets)`); vocab padding rows get none."""
    _grads_vs_transformers(case, tmp_path, fused)


@pytest.mark.slow
def test_compiled_blocks_match_transformers(tmp_path: Path) -> None:
    """torch.compile per block (plain-op norms and RoPE inside the graph) keeps the same gradients."""
    _grads_vs_transformers("llama2-70b-gqa", tmp_path, fused=True, compile=True)


def test_bf16_close_to_fp32(tmp_path: Path) -> None:
    """The same model cast to bf16 gives the fp32 logits to bf16's precision: every logit within
    2 bf16 epsilons (2 x 2^-7) of the largest fp32 logit. Its error is bf16 rounding of the
    weights and of every activation, carried through 2 layers into a sum of 64 products per
    logit: measured 0.0205 here (0.77% of the largest logit, 2.66; mean 0.0039), and 0.59-0.89%
    of it over 6 weight seeds x 2 token draws, under the bound's 1.56% (0.0415 here)."""
    path = build("falcon-40b", tmp_path / "b")
    ours = ours_from_dir(path)
    ids = tokens(90, 16)
    with torch.no_grad():
        ref = ours(ids)
        got = ours.to(torch.bfloat16)(ids).float()
    scale = ref.abs().max().item()
    assert scale > 0.5, "test model too weak to detect errors"
    assert not torch.equal(got, ref), "the bf16 model gave the fp32 logits: it did not run in bf16"
    torch.testing.assert_close(got, ref, rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps * scale)


def test_meta_init_and_stage_subsets() -> None:
    """Built on the meta device then materialised; a pipeline stage keeps global layer names."""
    cfg = ModelConfig(family="llama", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
                      num_kv_heads=4, ffn_hidden_size=2048)  # fmt: skip
    with torch.device("meta"):
        stage = Decoder(cfg, layers=[4, 5], embed=False, head=False)
    assert list(stage.layers) == ["4", "5"]
    assert {k.split(".")[0] for k in stage.state_dict()} == {"layers"}
    assert "layers.4.attn.q_proj.weight" in stage.state_dict()
    small = Decoder(
        config_from_hf({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "intermediate_size": 64}, pad_multiple=64)
    )  # fmt: skip
    with torch.device("meta"):
        m = Decoder(small.config)
    m.to_empty(device="cpu")
    m.init_weights()
    assert torch.all(m.embed.weight[50:] == 0) and m.embed.weight[:50].std() > 0.01
    x = torch.randint(0, 50, (1, 8))
    h = Decoder(small.config, layers=[0], head=False)
    h.load_state_dict({k: v for k, v in m.state_dict().items() if k.startswith(("embed", "layers.0"))})
    t = Decoder(small.config, layers=[1], embed=False)
    t.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith(("embed", "layers.0"))})
    with torch.no_grad():
        assert_bitwise_equal(t(h(x)), m(x), "two stages vs the whole model")
