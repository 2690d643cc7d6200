"""A run's fingerprint: what a resumed run must share with the checkpoint it resumes from, by
manifest field (`checkpoints.check_resumable` compares them), computed without torch from the
manifest and the manifests of the artifacts it reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from mega_train.objectives import kind_of
from mega_train.run_layout import router_losses
from megacore.artifacts import CheckpointManifest, RunManifest, TokensManifest
from megacore.artifacts.reader import read_manifest_bytes
from megacore.artifacts.run_spec import DISTILL_FIELDS, GRPO_FIELDS
from megacore.artifacts.writer import sha256_bytes

if TYPE_CHECKING:
    from mega_train.lora_plan import LoraPlan
    from mega_train.objectives.reference_plan import Reference
    from mega_train.objectives.teacher_plan import Teacher


def fingerprint(
    run: RunManifest,
    init: tuple[Path, CheckpointManifest] | None,
    sources: list[tuple[Path, TokensManifest, float]],
    lora: LoraPlan | None = None,
    reference: Reference | None = None,
    teacher: Teacher | None = None,
) -> dict[str, str]:
    """What decides the model's start, the sequence of batches and the updates, by manifest field: a
    run resumes only from a checkpoint with the same values. The layout, the precision and
    train_steps may change (the schedule is stretched: `schedule.py`)."""
    out = {
        "$.data.split": json.dumps(run.data.split),
        "$.data.loss_on": run.data.loss_on,
        "$.data.packing": run.data.packing or ("pad" if kind_of(run).pairs else "pack"),
        "$.data.doc_mask": str(run.data.doc_mask),
        "$.seed": str(run.seed),
        "$.batch.seq_length": str(run.batch.seq_length),
        "$.batch.global_batch_size": str(run.batch.global_batch_size),
        "$.model.init": sha256_bytes(read_manifest_bytes(init[0])[1]) if init else "none",
        "$.data.sources": str(len(sources)),
    }
    if lora is not None:  # the adapters' shape and start; their base is $.model.init's
        out["$.lora"] = json.dumps(dataclasses.asdict(lora.lora))
        if lora.init is not None:
            out["$.lora.init"] = sha256_bytes(read_manifest_bytes(lora.init[0])[1])
    if run.objective.type != "lm":  # language modelling's runs keep their fingerprints
        out |= _objective_fingerprint(run, reference, teacher)
    out |= router_losses(run).fingerprint()  # a mixture's; checkpoints saved before had none: any
    for name, value in msgspec.structs.asdict(run.optimizer).items():
        out[f"$.optimizer.{name}"] = json.dumps(value)
    for i, (path, _, weight) in enumerate(sources):
        out[f"$.data.sources[{i}]"] = f"{sha256_bytes(read_manifest_bytes(path)[1])} weight {weight}"
    return out


def _objective_fingerprint(
    run: RunManifest, reference: Reference | None, teacher: Teacher | None
) -> dict[str, str]:
    """The objective's settings: a preference objective's as runs saved them before
    `reference_logps` (its value under "reference") and before distillation's settings, and the
    reference model apart, so that their checkpoints still resume; distillation's and its teacher."""
    spec = msgspec.json.decode(msgspec.json.encode(run.objective))  # rewards' specs as JSON
    if teacher is not None:
        out = {"$.objective": json.dumps({k: spec[k] for k in ("type", *DISTILL_FIELDS)}, sort_keys=True)}
        return out | {"$.objective.teacher": teacher.manifest_sha256}
    if run.objective.type == "grpo":
        kept = ("type", "beta", "loss", "temperature", *GRPO_FIELDS)
        return {"$.objective": json.dumps({k: spec[k] for k in kept}, sort_keys=True)}
    for name in (*DISTILL_FIELDS, *GRPO_FIELDS):
        del spec[name]
    spec["reference"] = spec.pop("reference_logps")
    out = {"$.objective": json.dumps(spec, sort_keys=True)}
    if reference is not None:
        out["$.objective.reference"] = f"{reference.kind} {reference.manifest_sha256 or ''}".strip()
    return out
