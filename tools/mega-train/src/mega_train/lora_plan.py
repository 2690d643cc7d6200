"""A run manifest's `lora` section checked and resolved without torch (`megacore.models.adapters`
has the rules): the adapters' settings, the adapter it continues (`lora.init`) and what the run's
checkpoints record of their base."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from megacore.artifacts import CheckpointManifest, RunManifest, open_artifact, resolve_ref
from megacore.artifacts.manifest import Adapter, HFSource, NF4Blocks
from megacore.artifacts.reader import Verify, base_record, check_model_tensors, read_manifest_bytes
from megacore.artifacts.writer import sha256_bytes
from megacore.config import NF4_BLOCK, NF4_SCALER_BLOCK, LoRA, ModelConfig
from megacore.errors import UserError
from megacore.models.adapters import adapter_settings, check_rank, check_targets, modules
from megacore.parts import adapter_tensors


@dataclass(frozen=True)
class LoraPlan:
    """The resolved adapters, the adapter checkpoint they start from (None: fresh, as PEFT's), and
    their base: the run's `model.init`, by path and manifest sha256, and the Hugging Face model its
    weights came from."""

    lora: LoRA
    init: tuple[Path, CheckpointManifest] | None
    base: Path
    base_sha256: str
    base_source: HFSource | None = None

    def trained_parameters(self, config: ModelConfig) -> int:
        """The adapters' parameters: all the run trains."""
        shapes = adapter_tensors(config, self.lora.modules, self.lora.rank)
        return sum(math.prod(s) for s in shapes.values())

    def summary(self) -> dict:
        """The resolved settings as the dry run's JSON has them (the module names left out)."""
        return {k: v for k, v in dataclasses.asdict(self.lora).items() if k != "modules"}

    def adapter(self, checkpoint: Path) -> Adapter:
        """What the run's checkpoint at `checkpoint` records of the adapters it holds."""
        lo = self.lora
        base = base_record(self.base, self.base_sha256, checkpoint, self.base_source)
        return Adapter(
            rank=lo.rank,
            alpha=lo.alpha,
            targets=list(lo.targets),
            base=base,
            dropout=lo.dropout,
            rslora=lo.rslora,
            base_dtype=lo.base_dtype,
            nf4=NF4Blocks(NF4_BLOCK, NF4_SCALER_BLOCK) if lo.base_dtype == "nf4" else None,
        )


def plan_lora(
    run: RunManifest, init: tuple[Path, CheckpointManifest] | None, base: Path, verify: Verify, where: str
) -> LoraPlan | None:
    """`$.lora` checked against the base model (`model.init`) and resolved; None without one."""
    spec = run.lora
    if spec is None:
        return None
    if init is None:
        raise UserError("LoRA trains adapters on a checkpoint: give it as $.model.init", f"{where}: $.lora")
    if init[1].adapter is not None:
        raise UserError(
            f"{init[0]} is a LoRA adapter; $.model.init is the base checkpoint (an adapter goes in $.lora.init)",
            f"{where}: $.model.init",
        )
    if run.precision == "fp8":
        raise UserError("LoRA with precision fp8 is not supported: use bf16", f"{where}: $.precision")
    if spec.base_dtype == "nf4" and importlib.util.find_spec("torchao") is None:
        raise UserError(
            "nf4 (QLoRA) needs torchao, which is not installed (pip install torchao)",
            f"{where}: $.lora.base_dtype",
        )
    base_sha = sha256_bytes(read_manifest_bytes(init[0])[1])
    adapter = _open_adapter(base, spec.init, base_sha, verify, where) if spec.init is not None else None
    lora = _settings(run, adapter[1].adapter if adapter is not None else None, where)
    check_targets(init[1].config, lora.targets, f"{where}: $.lora.targets")
    check_rank(init[1].config, lora, f"{where}: $.lora.rank")
    lora = dataclasses.replace(lora, modules=tuple(modules(init[1].config, lora.targets)))
    return LoraPlan(lora, adapter, init[0], base_sha, init[1].hf_source)


def _open_adapter(
    base: Path, ref: str, base_sha: str, verify: Verify, where: str
) -> tuple[Path, CheckpointManifest]:
    """`$.lora.init`: an adapter checkpoint made for this base (its manifest's sha256)."""
    path = resolve_ref(base, ref)
    at = f"{where}: $.lora.init"
    try:
        manifest = open_artifact(path, "checkpoint", verify=verify)
    except UserError as e:  # its line names the artifact; this names the field too
        raise type(e)(str(e), at) from None
    if manifest.adapter is None:
        raise UserError(f"{path} is not a LoRA adapter (a whole model goes in $.model.init)", at)
    if manifest.adapter.base.manifest_sha256 != base_sha:
        raise UserError(
            f"{path} is an adapter of another base ({manifest.adapter.base.path}), not of $.model.init", at
        )
    check_model_tensors(manifest, f"{at}: {path}")
    return path, manifest


def _settings(run: RunManifest, adapter: Adapter | None, where: str) -> LoRA:
    """The adapters' settings: the manifest's, or those of the adapter it continues (a field set
    to another value than the adapter's is refused)."""
    spec = run.lora
    if adapter is None:
        if not spec.targets:
            raise UserError(
                "give the modules to adapt, by their Hugging Face names (PEFT's target_modules), "
                'e.g. ["q_proj", "v_proj"]',
                f"{where}: $.lora.targets",
            )
        rank = spec.rank or 8
        alpha = spec.alpha if spec.alpha is not None else float(rank)
        return LoRA(rank, alpha, tuple(spec.targets), spec.dropout, spec.rslora, spec.base_dtype)
    for name, theirs in (("rank", adapter.rank), ("alpha", adapter.alpha), ("targets", adapter.targets)):
        ours = getattr(spec, name)
        if ours is not None and ours != theirs:
            raise UserError(
                f"{ours!r} differs from the adapter's {theirs!r} ($.lora.init sets it; leave it out)",
                f"{where}: $.lora.{name}",
            )
    if spec.rslora != adapter.rslora:
        raise UserError(f"the adapter's rslora is {adapter.rslora}; leave it out", f"{where}: $.lora.rslora")
    return adapter_settings(adapter, spec.dropout, spec.base_dtype)
