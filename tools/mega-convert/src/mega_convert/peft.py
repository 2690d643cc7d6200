"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) -> an adapter
checkpoint artifact of a base checkpoint (`megacore.models.adapters`), which a run continues with
`"lora": {"init": OUT}`.

The base must be given (`--base`): PEFT's files name their base only informally, and the adapter's
module names, shapes and the targets it may have are the base's. What PEFT can say and LoRA here
does not do is refused by name: another PEFT type, DoRA, trained biases, extra trained modules,
per-module ranks, a regex `target_modules`, layers left out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from mega_convert import __version__
from megacore.artifacts import TORCH_DTYPES, open_artifact, whole
from megacore.artifacts.header import float_dtype
from megacore.artifacts.manifest import Adapter, Layout
from megacore.artifacts.output import recipe_sha256, reusable, write_artifact
from megacore.artifacts.reader import base_record, parent_of
from megacore.artifacts.writer import sha256_file
from megacore.checkpoint import CheckpointWriter, dtype_of, shard_file
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.adapters import check_targets, modules, peft_names
from megacore.parts import adapter_tensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# adapter_config.json keys whose non-default value LoRA here cannot honour, and what it needs.
_REFUSED = {
    "use_dora": (False, "DoRA"),
    "bias": ("none", "trained biases"),
    "modules_to_save": (None, "extra trained modules (modules_to_save)"),
    "layers_to_transform": (None, "some layers only (layers_to_transform)"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights"),
}


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_config.json, checked for a LoRA this tool can carry over."""
    path = adapter_dir / CONFIG
    if not path.is_file():
        raise UserError(f"no {CONFIG} (expected a PEFT adapter directory)", str(adapter_dir))
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"not JSON: {e}", str(path)) from None
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"$.peft_type: {cfg.get('peft_type')!r} is not supported (LORA)", str(path))
    for key, (default, what) in _REFUSED.items():
        if cfg.get(key, default) not in (default, None, [], {}):
            raise UserError(f"$.{key}: {what} is not supported", str(path))
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise UserError(
            "$.target_modules: expected a list of module names (a regex is not supported)", str(path)
        )
    return cfg


def convert_peft(
    adapter_dir: Path, out: Path, base: Path, *, dtype: str | None = None, force: bool = False
) -> dict[str, Any]:
    """Write the PEFT adapter at `adapter_dir`, made for the model of checkpoint `base`, as an
    adapter checkpoint at `out`; returns a summary."""
    t0 = time.perf_counter()
    adapter_dir, out, base = Path(adapter_dir), Path(out), Path(base)
    cfg = read_adapter_config(adapter_dir)
    base_manifest = open_artifact(base, "checkpoint")
    if base_manifest.adapter is not None:
        raise UserError(f"{base} is itself an adapter; give the base model's checkpoint", "--base")
    config = base_manifest.config
    parent = parent_of(base)
    weights = adapter_dir / WEIGHTS
    if not weights.is_file():
        raise UserError(f"no {WEIGHTS} (a pickled adapter_model.bin is not read)", str(adapter_dir))
    recipe = recipe_sha256(
        adapter=sha256_file(weights),
        config=sha256_file(adapter_dir / CONFIG),
        base=parent.manifest_sha256,
        dtype=dtype,
    )
    summary = {"out": str(out), "family": config.family, "rank": int(cfg["r"])}
    if not force and reusable(out, "checkpoint", recipe) is not None:
        return {**summary, "reused": True, "seconds": round(time.perf_counter() - t0, 3)}
    info = Adapter(
        rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)), targets=list(cfg["target_modules"]),
        base=base_record(base, parent.manifest_sha256, out, base_manifest.hf_source),
        dropout=float(cfg.get("lora_dropout", 0.0)), rslora=bool(cfg.get("use_rslora", False)),
    )  # fmt: skip
    check_targets(config, info.targets, f"{adapter_dir / CONFIG}: $.target_modules")
    tensors = _ours(load_file(str(weights)), config, info, str(weights))
    if dtype is not None:
        tensors = {n: t.to(TORCH_DTYPES[float_dtype(dtype)]) for n, t in tensors.items()}
    with write_artifact(out, "checkpoint", inputs=[base], force=force, recipe=recipe) as w:
        cw = CheckpointWriter(w)
        cw.write_file(shard_file(0, 0), [(n, t.shape, whole(t.shape), t) for n, t in tensors.items()])
        cw.commit(
            config=config, dtype=dtype_of(next(iter(tensors.values()))), producer=("mega-convert", __version__),
            layout=Layout(stage_layers=[list(range(config.num_layers))]), parents=[parent], adapter=info,
        )  # fmt: skip
    return {
        **summary,
        "reused": False,
        "tensors": len(tensors),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _ours(peft: dict, config: ModelConfig, info: Adapter, where: str) -> dict:
    """PEFT's tensors under our names, every one the targets imply there with its shape, no other."""
    names = peft_names(config)
    expected = adapter_tensors(config, modules(config, info.targets), info.rank)
    out = {}
    for ours, shape in expected.items():
        module, _, tensor = ours.rpartition(".lora_")
        theirs = f"{names[module]}.lora_{tensor}"
        t = peft.pop(theirs, None)
        if t is None:
            raise UserError(f"{theirs}: missing; the targets and the base imply {list(shape)}", where)
        if tuple(t.shape) != shape:
            raise UserError(
                f"{theirs}: shape {list(t.shape)}, the base and rank {info.rank} imply {list(shape)}", where
            )
        out[ours] = t.contiguous()
    if peft:
        raise UserError(f"{sorted(peft)[0]}: not a LoRA tensor of the targets on this base", where)
    return out
