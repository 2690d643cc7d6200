"""Manifests of earlier format versions read as today's (`codec.decode_manifest` calls `upgrade` on
the decoded JSON before its strict decoding), one step per version, so every artifact an earlier
release wrote still loads, trains and exports.

Version 2 took a mixture of experts' training settings out of the model config
(`megacore.config.RouterLosses`, the run's): a version 1 checkpoint's `config.router_*` move to the
fingerprint of the run that saved it (`training.run`, as today's runs record them, so a resume
still refuses a change and export still reads what it trained with); a version 1 run manifest's
`model.config.router_*` move beside it to `model.router_*`, and its `model.router_*` null (then:
the init's) are dropped (now: 0, a resume from a checkpoint trained otherwise refused by field).
"""

from __future__ import annotations

from typing import Any

from megacore.config import V1_ROUTER_FIELDS, RouterLosses


def upgrade(raw: dict[str, Any], version: int) -> dict[str, Any]:
    """`raw`, a manifest of format `version` decoded as plain JSON, in today's format."""
    if version < 2:
        raw = _router_settings_to_the_run(raw)
    return raw


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
