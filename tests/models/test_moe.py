"""The mixture-of-experts MLP (models/moe.py) against transformers' Mixtral and Qwen 3 MoE (top-k
renormalised or not): logits, every gradient, the load-balancing loss (transformers' own
`load_balancing_loss_func`) and its gradient, the z-loss against its closed form, and a router
that sends every token to the same experts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hf_cases import CASES as CASES_HF
from hf_cases import build, load_hf, tokens
from megacore.models import Decoder, config_from_hf, export_tensors, hf_state_dict_to_ours
from megacore.models.moe import MoE

COEF = 0.02  # large enough that the aux loss's share of each router gradient shows


# hf_cases' case -> its experts, top-k, and the names its checkpoints give a layer's router and
# experts: the module holding `gate` and `experts.<j>`, each expert's gate, up and down projections.
CASES = {
    "mixtral": (4, 2, "block_sparse_moe", ("w1", "w3", "w2")),
    "mixtral8": (8, 2, "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3-moe": (4, 2, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3-moe-unnormed": (8, 3, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3-moe-dense-layers": (4, 2, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2-moe": (4, 2, "mlp", ("gate_proj", "up_proj", "down_proj")),
}
# Not through `_pair` (its router is no softmax, it has no load-balancing loss): its own test.
DEEPSEEK = {"deepseek-v3": (8, 2, "mlp", ("gate_proj", "up_proj", "down_proj"))}
UNNORMED = ("qwen3-moe-unnormed", "qwen2-moe")


def _pair(tmp_path: Path, case: str = "mixtral", layers: int = 2) -> tuple[torch.nn.Module, Decoder]:
    experts, k = CASES[case][:2]
    n = {"num_local_experts": experts} if case.startswith("mixtral") else {}
    path = build(case.removesuffix("8"), tmp_path / "hf", num_hidden_layers=layers, router_aux_loss_coef=COEF,
                 output_router_logits=True, **n)  # fmt: skip
    hf = load_hf(path)
    cfg = config_from_hf(hf.config)
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token) == (experts, k)  # COEF: the run's, set below
    assert cfg.moe.router.renormalize_top_k == (case not in UNNORMED)
    ours = Decoder(cfg)
    ours.load_state_dict(hf_state_dict_to_ours(cfg, load_file(path / "model.safetensors")))
    return hf.train(), ours.train()


def _hf_grads_as_saved(hf: torch.nn.Module, case: str) -> dict[str, torch.Tensor]:
    """transformers' gradients under the names its checkpoints use (what our export writes): its
    in-memory fused gate_up_proj [E, 2f, h] cut into each expert's gate and up projections."""
    experts, _, module, (w_gate, w_up, w_down) = {**CASES, **DEEPSEEK}[case]
    out = {}
    for name, p in hf.named_parameters():
        m = re.match(
            r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$", name
        )
        if m is None:
            out[name] = p.grad
            continue
        moe = f"{m.group(1)}.{module}"
        if m.group(2) == "gate.weight":
            out[f"{moe}.gate.weight"] = p.grad
        for j in range(experts):
            if m.group(2) == "experts.gate_up_proj":
                gate, up = p.grad[j].chunk(2, dim=0)
                out[f"{moe}.experts.{j}.{w_gate}.weight"], out[f"{moe}.experts.{j}.{w_up}.weight"] = gate, up
            elif m.group(2) == "experts.down_proj":
                out[f"{moe}.experts.{j}.{w_down}.weight"] = p.grad[j]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_losses_and_every_gradient_match_transformers(case: str, tmp_path: Path) -> None:
    """Language-model loss plus COEF x the load-balancing loss, as transformers' function gives
    each layer's (the mean over the layers: `load_balancing_loss`'s docstring): same logits, same
    losses, same gradients in every tensor (fp32, < 1e-4 absolute up to magnitude 1)."""
    hf, ours = _pair(tmp_path, case)
    experts, k = CASES[case][:2]
    ids = tokens(101, 17)
    x, y = ids[:, :-1], ids[:, 1:]
    out = hf(x)
    per_layer = [load_balancing_loss_func((g,), experts, k) for g in out.router_logits]
    aux_ref = torch.stack(per_layer).mean()
    (F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + COEF * aux_ref).backward()

    layers = [m for m in ours.modules() if isinstance(m, MoE)]
    for moe in layers:
        moe.aux_weight = COEF / len(layers)  # what the engine sets for one microbatch on one rank
    logits = ours(x)
    assert (logits - out.logits).abs().max() < 1e-4
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    aux = sum(float(m.stats.totals()[1][0]) for m in layers) / len(layers)
    assert abs(aux - aux_ref.item()) < 1e-5, (aux, aux_ref.item())
    # z-loss, its closed form on transformers' router logits
    z_ref = sum(torch.logsumexp(g, -1).square().mean() for g in out.router_logits) / len(layers)
    assert abs(sum(float(m.stats.totals()[1][1]) for m in layers) / len(layers) - z_ref.item()) < 1e-4

    got = dict(export_tensors(ours.config, {n: p.grad for n, p in ours.named_parameters()}.__getitem__))
    ref = _hf_grads_as_saved(hf, case)
    assert sorted(got) == sorted(ref)
    for name, g in ref.items():
        err = (got[name] - g).abs().max().item()
        assert err < 1e-4 * max(1.0, g.abs().max().item()), (name, err)
    routers = [n for n in ref if n.endswith(f"{CASES[case][2]}.gate.weight")]
    assert all(ref[n].abs().max() > 0 for n in routers)


def test_one_layer_aux_loss_is_transformers_models(tmp_path: Path) -> None:
    """With one layer the per-layer mean is exactly what MixtralForCausalLM reports as aux_loss."""
    hf, ours = _pair(tmp_path, layers=1)
    ids = tokens(101, 16)
    with torch.no_grad():
        ref = hf(ids).aux_loss
        ours(ids)
    (moe,) = [m for m in ours.modules() if isinstance(m, MoE)]
    assert abs(float(moe.stats.totals()[1][0]) - ref.item()) < 1e-5


def test_a_router_sending_every_token_to_the_same_experts_still_trains(tmp_path: Path) -> None:
    """Zero router weights: every probability ties, every token picks the same two experts, the
    other experts get no rows (and a zero gradient); forward, backward and the statistics work,
    and the load-balancing loss is experts x sum(fraction x mean probability) = 4 x (1 x 1/4 +
    1 x 1/4) = 2."""
    _, ours = _pair(tmp_path)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, MoE):
                m.router.weight.zero_()
                m.aux_weight = 0.01
    ids = tokens(101, 16)
    ours(ids[:, :-1], ids[:, 1:]).backward()
    for m in (m for m in ours.modules() if isinstance(m, MoE)):
        load = m.stats.totals()[0].tolist()
        assert sorted(load) == [0, 0, 30, 30], load  # 2 rows x 15 tokens, each to the same 2 experts
        assert abs(float(m.stats.totals()[1][0]) - 2.0) < 1e-6
        idle = [e for e, n in enumerate(load) if n == 0]
        assert all(m.experts.down_proj.weight.grad[e].abs().max() == 0 for e in idle)
        assert m.router.weight.grad.abs().max() > 0  # the balancing loss pushes the router


def test_what_the_decoder_cannot_express_is_refused() -> None:
    """Experts outside the families whose checkpoints carry them, router and expert settings
    without experts, dense layers that are not layers, a shared expert's gate without the expert;
    Qwen 3 MoE's dense layers read as the config says (one line naming the key where refused)."""
    import msgspec

    from megacore.config import ModelConfig
    from megacore.config_parts import MoESpec
    from megacore.errors import UserError

    small = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 48}  # fmt: skip
    with pytest.raises(ValueError, match="mixtral, qwen3, qwen2"):
        ModelConfig(family="llama", mlp=MoESpec(num_experts=4, experts_per_token=2), **small)
    # An expert setting of a dense MLP has nowhere to go: a manifest naming one is refused by name.
    for dense in ({"type": "dense", "num_experts": 4}, {"type": "dense", "router": {}}):
        with pytest.raises(msgspec.ValidationError, match=r"unknown field .* at `\$.mlp`"):
            msgspec.convert({**small, "family": "qwen3", "mlp": dense}, ModelConfig)
    moe = {"num_experts": 4, "experts_per_token": 2}
    with pytest.raises(ValueError, match="dense_layers must be layer indices below 2"):
        ModelConfig(family="qwen3", mlp=MoESpec(dense_layers=[2], **moe), **small)
    with pytest.raises(ValueError, match="increasing layer indices"):
        MoESpec(dense_layers=[1, 0], **moe)
    with pytest.raises(
        msgspec.ValidationError, match=r"missing required field `size` - at `\$.mlp.shared_expert`"
    ):
        msgspec.convert(
            {**small, "family": "qwen2", "mlp": {"type": "moe", **moe, "shared_expert": {"gate": True}}},
            ModelConfig,
        )
    assert ModelConfig(family="qwen3", mlp=MoESpec(**moe), **small).moe.router.renormalize_top_k
    hf = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "head_dim": 8,
          "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    cfg = config_from_hf(hf)
    assert (cfg.ffn_hidden_size, cfg.moe.dense_layers, cfg.moe.dense_ffn_hidden_size) == (16, [], None)
    # transformers: layer i is dense when in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    cfg = config_from_hf({**hf, "mlp_only_layers": [1], "decoder_sparse_step": 2})
    assert (cfg.moe.dense_layers, cfg.moe.dense_ffn_hidden_size) == ([0, 1, 2], 48)
    with pytest.raises(UserError, match="mlp_only_layers"):
        config_from_hf({**hf, "mlp_only_layers": "1"})


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-yarn"])
def test_deepseek_v3_logits_loss_and_every_gradient_match_transformers(case: str, tmp_path: Path) -> None:
    """DeepSeek V3 (hf_cases: latent attention with and without q's low-rank pair, YaRN's score
    scale, dense layers first, grouped sigmoid routing with its balancing bias, shared experts):
    logits, loss and every gradient equal transformers' (fp32, < 1e-4 absolute up to magnitude 1);
    the bias, a buffer there, takes none here either."""
    path = build(case, tmp_path / "hf")
    hf = load_hf(path).train()
    cfg = config_from_hf(hf.config)
    ours = Decoder(cfg)
    ours.load_state_dict(hf_state_dict_to_ours(cfg, load_file(path / "model.safetensors")))
    ids = tokens(120, CASES_HF[case][2] + 1)
    x, y = ids[:, :-1], ids[:, 1:]
    out = hf(x)
    F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).backward()
    logits = ours(x)
    assert (logits - out.logits).abs().max() < 1e-4
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    params = dict(ours.named_parameters())
    assert all(p.grad is None for n, p in params.items() if n.endswith("router_bias"))
    grads = {n: p.grad if p.requires_grad else torch.zeros_like(p) for n, p in params.items()}
    got = dict(export_tensors(cfg, grads.__getitem__))
    ref = _hf_grads_as_saved(hf, "deepseek-v3")
    assert sorted(set(got) - set(ref)) == sorted(n for n, _ in hf.named_buffers() if n in got)
    for name, g in ref.items():
        err = (got[name] - g).abs().max().item()
        assert err < 1e-4 * max(1.0, g.abs().max().item()), (name, err)
