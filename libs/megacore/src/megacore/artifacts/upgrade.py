"""Manifests of earlier format versions read as today's (`codec.decode_manifest` calls `upgrade` on
the decoded JSON before its strict decoding), one step per version, so every artifact an earlier
release wrote still loads, trains and exports.

Version 2 took a mixture of experts' training settings out of the model config
(`megacore.config.RouterLosses`, the run's): a version 1 checkpoint's `config.router_*` move to the
fingerprint of the run that saved it (`training.run`, as today's runs record them, so a resume
still refuses a change and export still reads what it trained with); a version 1 run manifest's
`model.config.router_*` move beside it to `model.router_*`, and its `model.router_*` null (then:
the init's) are dropped (now: 0, a resume from a checkpoint trained otherwise refused by field).

Version 3 made the model config's attention and MLP tagged parts (`megacore.config_parts`): a
version 2 config's flat latent-attention and mixture-of-experts fields move into `attention`
(`type` latent when `kv_lora_rank` is set) and `mlp` (`type` moe when `num_experts` is set; the
router's settings into `mlp.router`, the shared expert's into `mlp.shared_expert`). A dense or
standard config's flat fields at their old defaults are dropped; any other is left where it was,
so the strict decoding refuses it by name, as version 2 refused it.

Version 4 made the norm, the RoPE and the block parts too, and moved standard attention's switches
into its part: a version 3 config's `norm`, `norm_eps`, `norm_bias` become `norm` (its `type`,
`eps`, and `bias` where it is a LayerNorm: another norm had none to read), `rope_theta`,
`rope_scaling`, `local_rope_theta` become `rope` (`theta`, `scaling`, `local_theta`),
`parallel_attn`, `num_ln_in_parallel_attn`, `sandwich_norm` become `block` (`parallel` with its
`norms`, or `sequential` with its `sandwich_norm`; the other kind's setting had nothing to do), and
`attn_bias`, `attn_out_bias`, `qk_norm`, `attn_sinks`, `attn_scalar` move into standard attention
(`bias`, `out_bias`, `qk_norm`, `sinks`, `scalar`). Beside latent attention they are dropped at
their defaults and left where they were otherwise, to be refused by name.

Version 5 only added settings, each off by default: RoPE's `partial_rotary_factor` (GLM-4.5),
standard attention's `output_gate` and the `linear_attention` part (Qwen 3.5). A version 4 config
reads as it is; the version tells an earlier release that it cannot read what a later one wrote,
before its strict decoding would name the first new field.
"""

from __future__ import annotations

from typing import Any

from megacore.config import V1_ROUTER_FIELDS, RouterLosses


def upgrade(raw: dict[str, Any], version: int) -> dict[str, Any]:
    """`raw`, a manifest of format `version` decoded as plain JSON, in today's format."""
    if version < 2:
        raw = _router_settings_to_the_run(raw)
    if version < 3:
        for config in _configs(raw):
            _flat_fields_to_parts(config)
    if version < 4:
        for config in _configs(raw):
            _v3_fields_to_parts(config)
    return raw


# Version 2's flat fields: their path in the parts, and their default (what a dense MLP or standard
# attention held).
V2_LATENT = {
    "kv_lora_rank": (("kv_lora_rank",), None),
    "qk_rope_head_dim": (("qk_rope_head_dim",), None),
    "v_head_dim": (("v_head_dim",), None),
    "q_lora_rank": (("q_lora_rank",), None),
}
V2_MOE = {
    "num_experts": (("num_experts",), None),
    "experts_per_token": (("experts_per_token",), None),
    "renormalize_top_k": (("router", "renormalize_top_k"), True),
    "router_scoring": (("router", "scoring"), "softmax"),
    "router_bias": (("router", "bias"), False),
    "expert_groups": (("router", "groups"), None),
    "expert_groups_chosen": (("router", "groups_chosen"), None),
    "routed_scaling": (("router", "scaling"), 1.0),
    "shared_expert_size": (("shared_expert", "size"), None),
    "shared_expert_gate": (("shared_expert", "gate"), False),
    "dense_layers": (("dense_layers",), []),
    "dense_ffn_hidden_size": (("dense_ffn_hidden_size",), None),
}


def _configs(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The model configs a manifest holds: a checkpoint's, a run's new model's."""
    model = raw.get("model") if raw.get("kind") == "run" else None
    found = [raw.get("config")] if raw.get("kind") == "checkpoint" else []
    found += [model.get("config")] if isinstance(model, dict) else []
    return [c for c in found if isinstance(c, dict)]


def _flat_fields_to_parts(config: dict[str, Any]) -> None:
    for part, fields, key, tag in (
        ("attention", V2_LATENT, "kv_lora_rank", "latent"),
        ("mlp", V2_MOE, "num_experts", "moe"),
    ):
        if part in config:  # written by hand in today's format: left to the strict decoding
            continue
        if config.get(key) is None:
            for name, (_, default) in fields.items():
                if name in config and config[name] == default:
                    del config[name]
            continue
        nested: dict[str, Any] = {"type": tag}
        for name, (path, _) in fields.items():
            if name in config:
                *parents, leaf = path
                target = nested
                for p in parents:
                    target = target.setdefault(p, {})
                target[leaf] = config.pop(name)
        shared = nested.get("shared_expert")
        if shared is not None and shared.get("size") is None and not shared.get("gate"):  # none
            del nested["shared_expert"]
        config[part] = nested


# Version 3's flat fields of the parts version 4 made, and their names there.
V3_NORM = {"norm": "type", "norm_eps": "eps", "norm_bias": "bias"}
V3_ROPE = {"rope_theta": "theta", "rope_scaling": "scaling", "local_rope_theta": "local_theta"}
V3_STANDARD = {
    "attn_bias": ("bias", False),
    "attn_out_bias": ("out_bias", False),
    "qk_norm": ("qk_norm", False),
    "attn_sinks": ("sinks", False),
    "attn_scalar": ("scalar", None),
}


def _v3_fields_to_parts(config: dict[str, Any]) -> None:
    if "norm" not in config or isinstance(config["norm"], str):  # else today's: the strict decoding's
        norm = {"type": "rmsnorm"}
        norm.update({ours: config.pop(name) for name, ours in V3_NORM.items() if name in config})
        if norm["type"] != "layernorm":
            norm.pop("bias", None)
        config["norm"] = norm
    if "rope" not in config:
        config["rope"] = {ours: config.pop(name) for name, ours in V3_ROPE.items() if name in config}
    if "block" not in config:
        parallel, norms = config.pop("parallel_attn", False), config.pop("num_ln_in_parallel_attn", 1)
        sandwich = config.pop("sandwich_norm", False)
        block = {"type": "parallel", "norms": norms} if parallel else {"type": "sequential"}
        config["block"] = {**block, "sandwich_norm": sandwich} if sandwich or not parallel else block
    attention = config.setdefault("attention", {"type": "standard"})
    if not isinstance(attention, dict):
        return
    for name, (ours, default) in V3_STANDARD.items():
        if name not in config:
            continue
        if attention.get("type", "standard") == "standard":
            attention[ours] = config.pop(name)
        elif config[name] == default:
            del config[name]


def _router_settings_to_the_run(raw: dict[str, Any]) -> dict[str, Any]:
    kind = raw.get("kind")
    if kind == "checkpoint" and isinstance(raw.get("config"), dict):
        found = _pop_router(raw["config"])
        training = raw.get("training")
        if found is not None and raw["config"].get("num_experts") and isinstance(training, dict):
            training["run"] = {**RouterLosses(**found).fingerprint(), **training.get("run", {})}
    if kind == "run" and isinstance(raw.get("model"), dict):
        model = raw["model"]
        for name in V1_ROUTER_FIELDS:
            if name in model and model[name] is None:
                del model[name]
        found = _pop_router(model["config"]) if isinstance(model.get("config"), dict) else None
        for name, ours in V1_ROUTER_FIELDS.items():
            if found is not None and name not in model:
                model[name] = found[ours]
    return raw


def _pop_router(config: dict[str, Any]) -> dict[str, float] | None:
    """A version 1 config's router settings, removed from it (None: it set none)."""
    if not any(name in config for name in V1_ROUTER_FIELDS):
        return None
    return {ours: config.pop(name, 0.0) for name, ours in V1_ROUTER_FIELDS.items()}
