"""A distillation run's teacher resolved and checked without torch (`objective.teacher`).

The teacher is a whole model (a checkpoint: `mega-convert hf` of a Hugging Face model, or a run's),
frozen, run beside each microbatch in the student's layout (`objectives/distill.py`): tp splits
its vocab as the student's, so the divergence is vocab-parallel; cp and dp as the student's. It
may be larger than the student (more layers, another hidden size) but must share the student's
tokenizer: the divergence compares their distributions over the same ids. A pipeline or expert
parallelism is refused: the teacher's forward needs each microbatch's tokens where the student's
logits are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacore.artifacts import CheckpointManifest, RunManifest, TokensManifest, open_artifact, resolve_ref
from megacore.artifacts.reader import Verify, check_model_tensors, read_manifest_bytes
from megacore.artifacts.writer import sha256_bytes
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.parallel.layout import check_tp
from megacore.tokenizer_files import first_difference, recorded_vocabulary

AT = "$.objective.teacher"


@dataclass(frozen=True)
class Teacher:
    """A distillation run's resolved teacher."""

    path: Path
    manifest: CheckpointManifest
    manifest_sha256: str

    def describe(self, run: RunManifest) -> str:
        """The dry run's and the run's note on what the teacher is."""
        c, spec = self.manifest.config, run.objective
        return (
            f"distill's teacher: {self.path} ({c.family}, {c.num_layers} layers, hidden {c.hidden_size}); "
            f"{spec.divergence} at temperature {spec.temperature:g}, alpha {spec.alpha:g}"
        )


def plan_teacher(
    run: RunManifest,
    config: ModelConfig,
    sources: list[tuple[Path, TokensManifest, float]],
    base: Path,
    verify: Verify,
    where: str,
) -> Teacher | None:
    """`$.objective.teacher` checked against the run; None when the objective has no teacher."""
    spec = run.objective
    if spec.type != "distill":
        if spec.teacher is not None:
            raise UserError(f"{spec.type} has no teacher; leave {AT} out", where)
        return None
    if spec.teacher is None:
        raise UserError(f"distill needs a teacher: give {AT} (a checkpoint)", where)
    at = f"{where}: {AT}"
    path = resolve_ref(base, spec.teacher)
    if not (path / "manifest.json").is_file():
        raise UserError(f"{path} is not a checkpoint (no manifest.json)", at)
    manifest = open_artifact(path, "checkpoint", verify=verify)
    check_model_tensors(manifest, f"{at}: {path}")
    if manifest.adapter is not None:
        raise UserError(
            f"{path} is a LoRA adapter; a teacher is a whole model (mega-export it merged, then mega-convert hf)",
            at,
        )
    _check_tokenizer(path, manifest, config, sources, at)
    _check_layout(run, manifest.config, at)
    return Teacher(path, manifest, sha256_bytes(read_manifest_bytes(path)[1]))


def _check_tokenizer(
    path: Path,
    manifest: CheckpointManifest,
    config: ModelConfig,
    sources: list[tuple[Path, TokensManifest, float]],
    at: str,
) -> None:
    """The teacher's vocab is the student's, and its tokenizer the data's where it records one."""
    theirs = manifest.config.vocab_size
    if theirs != config.vocab_size:
        raise UserError(
            f"{path} has vocab_size {theirs} and the student {config.vocab_size}: a teacher shares the "
            "student's tokenizer",
            at,
        )
    recorded = recorded_vocabulary(path, manifest)
    data, tokens, _ = sources[0]
    ours = recorded_vocabulary(data, tokens)
    diff = first_difference(recorded, ours) if recorded is not None and ours is not None else None
    if diff is not None:
        i, there, here = diff
        raise UserError(
            f"{path} was trained with another tokenizer than the data {data}: id {i} is {there!r} there "
            f"and {here!r} here",
            at,
        )


def _check_layout(run: RunManifest, teacher: ModelConfig, at: str) -> None:
    """The layouts the teacher runs in beside the student, and the context it must hold."""
    par = run.parallel
    for name in ("pp", "ep"):
        if getattr(par, name) > 1:
            raise UserError(
                f"$.parallel.{name} {getattr(par, name)}: distillation runs the teacher beside each "
                "microbatch, without a pipeline or expert parallelism; use tp, cp or dp",
                at,
            )
    check_tp(teacher, par.tp, f"{at}: the teacher at $.parallel.tp")
    if teacher.max_seq_len < run.batch.seq_length:
        raise UserError(
            f"the teacher holds {teacher.max_seq_len} positions, fewer than $.batch.seq_length "
            f"{run.batch.seq_length}",
            at,
        )
