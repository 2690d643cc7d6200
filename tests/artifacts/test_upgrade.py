"""Manifests of earlier format versions read as today's (`megacore.artifacts.upgrade`). Version 2: a
mixture of experts' training settings left the model config for the run (#50). Version 3: the
config's attention and MLP became tagged parts. Version 4: its norm, RoPE and block parts, and
standard attention's switches in its part. The v1 manifests are the fixture an earlier main
wrote (tests/fixtures/e9be15e/) and that fixture's manifest turned into a mixture's by hand, as a
version 1 Mixtral checkpoint trained with a load-balancing weight records it; the v2 ones are that
fixture as version 2 wrote a DeepSeek V3 config, its latent attention and experts flat; the v3
ones that fixture as version 3 wrote a Gemma 3, a Falcon and a DeepSeek V3 config."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mega_train.checkpoints import check_resumable
from megacore.artifacts import FORMAT_VERSION
from megacore.artifacts.codec import decode_manifest
from megacore.config import RouterLosses
from megacore.config_parts import (
    LatentAttentionSpec,
    LayerNormSpec,
    MoESpec,
    ParallelBlockSpec,
    PlusOneRMSNormSpec,
    RMSNormSpec,
    RopeScaling,
    RopeSpec,
    RouterSpec,
    SequentialBlockSpec,
    SharedExpertSpec,
    StandardAttentionSpec,
)
from megacore.errors import UserError

TRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "e9be15e" / "trained" / "manifest.json"
ROUTER = ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update")
# Version 2's flat fields of latent attention and of a mixture of experts.
V2_PARTS = (
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "num_experts", "experts_per_token",
    "renormalize_top_k", "dense_layers", "dense_ffn_hidden_size", "shared_expert_size", "shared_expert_gate",
    "router_scoring", "router_bias", "expert_groups", "expert_groups_chosen", "routed_scaling",
)  # fmt: skip
# Version 3's flat fields of the norm, the RoPE, the block and standard attention.
V3_PARTS = (
    "norm", "norm_eps", "norm_bias", "rope_theta", "rope_scaling", "local_rope_theta", "parallel_attn",
    "num_ln_in_parallel_attn", "sandwich_norm", "attn_bias", "attn_out_bias", "qk_norm", "attn_sinks",
    "attn_scalar",
)  # fmt: skip


def _v1_mixtral(aux: float) -> dict:
    raw = json.loads(TRAINED.read_text())
    raw["config"] |= {
        "family": "mixtral",
        "num_experts": 4,
        "experts_per_token": 2,
        "router_aux_loss_coef": aux,
    }
    return raw


def test_the_fixture_is_version_1_with_the_router_fields_in_its_config() -> None:
    raw = json.loads(TRAINED.read_text())
    assert raw["format_version"] == 1 < FORMAT_VERSION == 5
    assert {k: raw["config"][k] for k in ROUTER} == dict.fromkeys(ROUTER, 0.0)


def test_a_dense_v1_checkpoint_drops_its_zero_router_settings_and_keeps_its_fingerprint() -> None:
    raw = json.loads(TRAINED.read_text())
    m = decode_manifest(TRAINED.read_bytes(), "fixture", "checkpoint")
    encoded = json.loads(msgspec.json.encode(m.config))
    assert not set(ROUTER) & set(encoded)
    kept = {k: v for k, v in raw["config"].items() if k not in (*ROUTER, *V2_PARTS, *V3_PARTS)}
    assert {k: v for k, v in encoded.items() if k in kept} == kept
    assert m.config.attention == StandardAttentionSpec() and encoded["mlp"] == {"type": "dense"}
    assert (m.config.norm, m.config.rope, m.config.block) == (
        RMSNormSpec(eps=1e-6),
        RopeSpec(),
        SequentialBlockSpec(),
    )
    assert m.training.fingerprint == raw["training"]["run"]  # nothing added for a dense model


def test_a_v1_mixtures_router_weight_moves_to_its_runs_fingerprint(tmp_path: Path) -> None:
    """The weight it trained with is what export reads and what a resume must keep: the same 0.02
    resumes, 0 (today's default) is refused naming the run manifest's field."""
    m = decode_manifest(json.dumps(_v1_mixtral(0.02)).encode(), "v1", "checkpoint")
    assert RouterLosses.from_fingerprint(m.training.fingerprint) == RouterLosses(aux_loss_coef=0.02)
    same = RouterLosses(aux_loss_coef=0.02).fingerprint()
    check_resumable(tmp_path, m, m.config, same, "run.json")
    with pytest.raises(UserError, match=r"^run\.json: \$\.model\.router_aux_loss_coef differs from the run"):
        check_resumable(tmp_path, m, m.config, RouterLosses().fingerprint(), "run.json")


def test_a_v1_run_manifest_sets_its_configs_router_weights_beside_it() -> None:
    run = {
        "kind": "run", "format_version": 1, "out": "run", "train_steps": 1,
        "model": {"config": _v1_mixtral(0.05)["config"], "router_z_loss_coef": None},
        "data": {"sources": [{"path": "tokens"}]},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 8},
    }  # fmt: skip
    m = decode_manifest(json.dumps(run).encode(), "run.json", "run")
    assert (m.model.router_aux_loss_coef, m.model.router_z_loss_coef, m.model.router_bias_update) == (
        0.05,
        0.0,
        0.0,
    )
    assert m.model.config.moe == MoESpec(num_experts=4, experts_per_token=2)


# A DeepSeek V3 config as format version 2 wrote it: every setting of its parts a flat field.
V2_DEEPSEEK = {
    "family": "deepseek_v3", "num_heads": 4, "num_kv_heads": 4, "head_dim": 24, "num_layers": 2,
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "num_experts": 4, "experts_per_token": 2, "renormalize_top_k": False, "dense_layers": [0],
    "dense_ffn_hidden_size": 64, "shared_expert_size": 24, "shared_expert_gate": False,
    "router_scoring": "sigmoid", "router_bias": True, "expert_groups": 2, "expert_groups_chosen": 1,
    "routed_scaling": 2.5,
}  # fmt: skip


def _v2(config: dict) -> bytes:
    raw = json.loads(TRAINED.read_text())
    raw["format_version"] = 2
    raw["config"] = {k: v for k, v in raw["config"].items() if k not in ROUTER} | config
    return json.dumps(raw).encode()


def test_a_v2_config_s_flat_latent_and_expert_fields_become_its_parts() -> None:
    m = decode_manifest(_v2(V2_DEEPSEEK), "v2", "checkpoint")
    assert m.config.attention == LatentAttentionSpec(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12)
    assert m.config.mlp == MoESpec(
        num_experts=4, experts_per_token=2, dense_layers=[0], dense_ffn_hidden_size=64,
        shared_expert=SharedExpertSpec(size=24),
        router=RouterSpec(scoring="sigmoid", renormalize_top_k=False, bias=True, groups=2, groups_chosen=1, scaling=2.5),
    )  # fmt: skip


def test_a_dense_v2_config_drops_its_defaults_and_refuses_any_other_by_name() -> None:
    """A dense config's expert fields at version 2's defaults (what every v2 config wrote) go; one
    set without experts was refused by version 2 and still is, naming it."""
    dense = dict.fromkeys(("num_experts", "experts_per_token", "kv_lora_rank", "shared_expert_size"))
    m = decode_manifest(_v2({**dense, "router_bias": False, "dense_layers": []}), "v2", "checkpoint")
    assert (m.config.moe, m.config.latent) == (None, None)
    with pytest.raises(UserError, match=r"^v2: \$\.config: object contains unknown field routed_scaling$"):
        decode_manifest(_v2({**dense, "routed_scaling": 2.5}), "v2", "checkpoint")


def _v3(config: dict) -> bytes:
    """The fixture as version 3 wrote it, with `config`'s fields over its own."""
    raw = json.loads(TRAINED.read_text())
    raw["format_version"] = 3
    flat = {k: v for k, v in raw["config"].items() if k not in (*ROUTER, *V2_PARTS)}
    raw["config"] = flat | {"attention": {"type": "standard"}, "mlp": {"type": "dense"}} | config
    return json.dumps(raw).encode()


def test_v3_gemma_and_falcon_switches_become_their_parts() -> None:
    gemma = {
        "family": "gemma3", "norm": "rmsnorm_plus1", "norm_eps": 1e-6, "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 8.0}, "local_rope_theta": 1e4, "sandwich_norm": True,
        "qk_norm": True, "attn_scalar": 24.0, "sliding_window": 4, "scale_embeddings": True,
    }  # fmt: skip
    m = decode_manifest(_v3(gemma), "v3", "checkpoint")
    assert (m.config.norm, m.config.block) == (
        PlusOneRMSNormSpec(eps=1e-6),
        SequentialBlockSpec(sandwich_norm=True),
    )
    assert m.config.rope == RopeSpec(
        theta=1e6, scaling=RopeScaling(type="linear", factor=8.0), local_theta=1e4
    )
    assert m.config.attention == StandardAttentionSpec(qk_norm=True, scalar=24.0)
    falcon = {"family": "falcon", "norm": "layernorm", "norm_bias": True, "parallel_attn": True,
              "num_ln_in_parallel_attn": 2, "attn_bias": True, "attn_out_bias": True, "mlp_bias": True}  # fmt: skip
    m = decode_manifest(_v3(falcon), "v3", "checkpoint")
    assert (m.config.norm, m.config.block) == (LayerNormSpec(eps=1e-6, bias=True), ParallelBlockSpec(norms=2))
    assert m.config.attention == StandardAttentionSpec(bias=True, out_bias=True) and m.config.mlp_bias


def test_v3_settings_that_did_nothing_go_and_latent_attention_refuses_standard_ones_by_name() -> None:
    """A norm bias beside an RMSNorm, a parallel block's norm count beside a sequential one, and
    standard attention's switches at their defaults beside latent attention read nothing in version 3
    and are dropped; a standard switch set beside latent attention was refused and still is."""
    latent = {"family": "deepseek_v3", "num_heads": 2, "num_kv_heads": 2, "head_dim": 24,
              "attention": {"type": "latent", "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}}  # fmt: skip
    m = decode_manifest(_v3({**latent, "norm_bias": True, "num_ln_in_parallel_attn": 2}), "v3", "checkpoint")
    assert (m.config.norm, m.config.block) == (RMSNormSpec(eps=1e-6), SequentialBlockSpec())
    assert m.config.latent == LatentAttentionSpec(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12)
    with pytest.raises(UserError, match=r"^v3: \$\.config: object contains unknown field attn_sinks$"):
        decode_manifest(_v3({**latent, "attn_sinks": True}), "v3", "checkpoint")
