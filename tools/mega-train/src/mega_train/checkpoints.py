"""A run's checkpoints: `step-00000012` checkpoint artifacts in one directory, a `latest` link to the
newest, keep-last-K, and which one a rerun resumes from (and whether it may).

A checkpoint is complete when its `manifest.json` is there (the artifact writer writes it last and
renames the staging directory into place), so a write killed halfway leaves `step-N.partial/`,
which resuming ignores and the next save of that step replaces. `latest` is a convenience for
people (`mega-export run/checkpoints/latest hf`); resuming trusts only the manifests.

A complete checkpoint whose files no longer match its manifest (a truncated or overwritten shard
file) is *damaged*: found when the run starts (sizes, or sha256 with `--verify sha256`) or while
its files are read (every file is hashed as it is read), it is named on one line and set aside as
`step-N.damaged` (renamed, never deleted), `latest` moves to the newest intact checkpoint, and the
run resumes from that one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from megacore.artifacts import CheckpointManifest, open_artifact
from megacore.artifacts.output import remove_artifact
from megacore.artifacts.reader import Verify
from megacore.config import ModelConfig, config_differences
from megacore.errors import UserError

PRODUCER = "mega-train"
LATEST = "latest"
_STEP = re.compile(r"step-(\d{8})")


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:08d}"


def complete(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = []
    for p in checkpoints.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and not p.is_symlink() and (p / "manifest.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resume_point(
    checkpoints: Path, verify: Verify = "size"
) -> tuple[tuple[Path, CheckpointManifest] | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of a training run that opens cleanly (files checked as
    `verify` says, pieces against their headers), and the damaged ones newer than it with why."""
    damaged = []
    for _, path in reversed(complete(checkpoints)):
        try:
            manifest = open_artifact(path, "checkpoint", verify=verify)
        except UserError as e:
            damaged.append((path, str(e)))
            continue
        if manifest.training is not None:
            return (path, manifest), damaged
    return None, damaged


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to `step-N.damaged` (`.damaged-2`, ... when taken): kept for a
    person to look at, and out of the way of resuming, pruning and the next save of its step."""
    target, n = path.with_name(f"{path.name}.damaged"), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    path.rename(target)
    return target


def check_resumable(
    path: Path,
    manifest: CheckpointManifest,
    config: ModelConfig,
    fingerprint: dict[str, str],
    where: str,
    field: Callable[[str], str] = lambda name: f"$.model.config.{name}",
) -> None:
    """A run resumes only from a checkpoint of the same model and data; the refusal names the field,
    a config field where `field` says the manifest sets it (`RunPlan.config_field`). The context
    (max_seq_len, rope_scaling) is the model's too: changing it on resume is refused."""
    diff = config_differences(config, manifest.config)
    if diff:
        raise UserError(
            f"{field(diff[0])} differs from the checkpoint {path} this run would resume from; "
            "give the run another `out` (or restore the manifest)",
            where,
        )
    saved = manifest.training.fingerprint if manifest.training is not None else {}
    for field, value in fingerprint.items():
        if saved.get(field, value) != value:
            raise UserError(
                f"{field} differs from the run that saved {path}, so it cannot resume from it; give the "
                "run another `out` (or restore the manifest)",
                where,
            )


def point_latest(checkpoints: Path, path: Path | None) -> None:
    """Make `latest` a relative link to `path`, replaced atomically (removed when None)."""
    link = checkpoints / LATEST
    if link.exists() and not link.is_symlink():
        return  # someone else's file: not ours to replace
    if path is None:
        link.unlink(missing_ok=True)
        return
    tmp = checkpoints / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    os.replace(tmp, link)


def prune(checkpoints: Path, keep: int | None) -> list[Path]:
    """Remove complete checkpoints this tool wrote beyond the newest `keep`; returns the removed."""
    if keep is None:
        return []
    return [
        path for _, path in complete(checkpoints)[:-keep] if remove_artifact(path, "checkpoint", PRODUCER)
    ]
