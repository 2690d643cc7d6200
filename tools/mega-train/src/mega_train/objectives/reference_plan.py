"""A DPO run's reference model resolved and checked without torch (`objective.reference`).

The reference is what the policy's log-probabilities are compared with; DPO's loss and rewards are
differences from it, so at the first step of a run whose reference is the model it starts from,
the rewards are 0. The choices, as TRL users know them (a reference adapter, or the SFT model as the
base):

- `base`: `model.init`'s model; under LoRA the base with its adapters off.
- `init`: the model as the run starts: the base with `lora.init`'s adapters (TRL's reference after
  SFT); the default when `lora.init` is set, and the same as `base` without it.
- a checkpoint: a whole model of the run's tensor shapes (its weights in the base's place, adapters
  off), or an adapter of the run's base with the run's adapter shapes (in the adapters' place).

Where the adapters carry the reference (`init`, an adapter), a live reference (`reference_logps`
live) costs no second copy of the base: the reference adapters' values are kept beside the trained
ones and swapped in for its forward (`mega_train.objectives.preference`). A whole-model reference is
precomputed only: live, it would be a second model in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mega_train.lora_plan import LoraPlan
from megacore.artifacts import CheckpointManifest, RunManifest, open_artifact, resolve_ref
from megacore.artifacts.reader import Verify, check_model_tensors, read_manifest_bytes
from megacore.artifacts.writer import sha256_bytes
from megacore.errors import UserError
from megacore.parts import model_tensors

AT = "$.objective.reference"


@dataclass(frozen=True)
class Reference:
    """A DPO run's resolved reference: `kind` base (no adapters), `adapters` (the base with the
    adapters of `path`: `lora.init`'s or another adapter checkpoint) or `model` (the whole model at
    `path`); `live`: its log-probabilities beside each step instead of once before training."""

    kind: Literal["base", "adapters", "model"]
    live: bool
    path: Path | None = None
    manifest_sha256: str | None = None
    said: str = "base"  # how the run manifest named it: base, init or the path
    lora: bool = False

    def describe(self) -> str:
        """The dry run's and the run's note on what the reference is."""
        when = "beside each step (live)" if self.live else "computed once before the first step"
        what = {
            "base": "$.model.init with the adapters off" if self.lora else "$.model.init's model",
            "adapters": f"$.model.init with the adapters of {self.path}",
            "model": f"the whole model {self.path}",
        }[self.kind]
        return f"dpo's reference ({self.said}): {what}; its log-probabilities {when}"

    def key(self) -> dict[str, str]:
        """What the stored log-probabilities depend on besides the data (nothing for `base`, so a
        reference stored before this key existed is still this run's)."""
        return {} if self.kind == "base" else {"reference": f"{self.kind} {self.manifest_sha256}"}


def plan_reference(
    run: RunManifest,
    init: tuple[Path, CheckpointManifest] | None,
    lora: LoraPlan | None,
    base: Path,
    verify: Verify,
    where: str,
) -> Reference | None:
    """`$.objective.reference` and `reference_logps` checked against the run; None when the
    objective has no reference (lm, simpo, orpo)."""
    spec = run.objective
    if spec.type != "dpo":
        if spec.reference is not None:
            raise UserError(f"{spec.type} has no reference model; leave {AT} out", where)
        return None
    live = spec.reference_logps == "live"
    if live and lora is None:
        raise UserError(
            "$.objective.reference_logps: live computes the reference beside each step from the model "
            "in memory, which a LoRA run has (its base, adapters switched); without LoRA it would be a "
            "second model: use precomputed",
            where,
        )
    said = spec.reference or ("init" if lora is not None and lora.init is not None else "base")
    if said == "base" or (said == "init" and (lora is None or lora.init is None)):
        return Reference("base", live, said=said, lora=lora is not None)
    if said == "init":
        path = lora.init[0]
        return Reference("adapters", live, path, _sha(path), "init", lora=True)
    return _checkpoint_reference(resolve_ref(base, said), init, lora, live, verify, where)


def _sha(path: Path) -> str:
    return sha256_bytes(read_manifest_bytes(path)[1])


def _checkpoint_reference(
    path: Path,
    init: tuple[Path, CheckpointManifest],
    lora: LoraPlan | None,
    live: bool,
    verify: Verify,
    where: str,
) -> Reference:
    """A checkpoint as the reference: a whole model of the run's shapes, or an adapter of its base
    and shapes (a LoRA run's)."""
    at = f"{where}: {AT}"
    if not (path / "manifest.json").is_file():
        raise UserError(f"{path} is not a checkpoint (no manifest.json); give base, init or a checkpoint", at)
    manifest = open_artifact(path, "checkpoint", verify=verify)
    check_model_tensors(manifest, f"{at}: {path}")
    if manifest.adapter is None:
        if model_tensors(manifest.config) != model_tensors(init[1].config):
            raise UserError(f"{path} is not a model of the run's shapes ($.model.init's tensors)", at)
        if live:
            raise UserError(
                f"a whole model as the reference would be a second model in memory beside each step; "
                f"precompute it ($.objective.reference_logps: precomputed) for {path}",
                where,
            )
        return Reference("model", live, path, _sha(path), str(path), lora=lora is not None)
    if lora is None:
        raise UserError(
            f"{path} is a LoRA adapter; a run without LoRA takes a whole model as its reference "
            "(mega-export it merged, then mega-convert hf)",
            at,
        )
    info = manifest.adapter
    if info.base.manifest_sha256 != lora.base_sha256:
        raise UserError(f"{path} is an adapter of another base than $.model.init", at)
    lo = lora.lora
    for name, theirs, ours in (
        ("rank", info.rank, lo.rank),
        ("alpha", info.alpha, lo.alpha),
        ("rslora", info.rslora, lo.rslora),
        ("targets", sorted(info.targets), sorted(lo.targets)),
    ):
        if theirs != ours:
            raise UserError(
                f"{path} has {name} {theirs}, the run's adapters {ours}: a reference adapter is "
                "swapped in for the run's, so it must have their shape and scale",
                at,
            )
    return Reference("adapters", live, path, _sha(path), str(path), lora=True)
