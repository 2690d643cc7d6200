"""Resolve a run manifest: decode it strictly, open every artifact it references, check sizes.

This is everything mega-train does before it touches a process group, so a bad run.json fails in
seconds with one line instead of after a torchrun launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacore.artifacts import CheckpointManifest, ModelConfig, RunManifest, TokensManifest, open_artifact
from megacore.artifacts.manifest import decode_manifest
from megacore.artifacts.reader import Verify, read_manifest_bytes
from megacore.errors import UserError
from megacore.parallel.engine import Parallelism, check_parallelism
from megacore.parallel.plan import check_world


@dataclass
class RunPlan:
    path: Path
    run: RunManifest
    config: ModelConfig
    init: CheckpointManifest | None
    data: list[tuple[Path, TokensManifest, float]]
    world_size: int
    dp: int
    grad_accum: int
    stage_layers: list[list[int]]

    def summary(self) -> dict:
        p = self.run.parallel
        return {
            "manifest": str(self.path),
            "model": {
                "family": self.config.family,
                "layers": self.config.num_layers,
                "hidden": self.config.hidden_size,
            },
            "init": self.run.model.init,
            "data": [{"path": str(d), "tokens": m.counts.tokens, "weight": w} for d, m, w in self.data],
            "parallel": {"world_size": self.world_size, "tp": p.tp, "pp": p.pp, "dp": self.dp},
            "stage_layers": self.stage_layers,
            "batch": {
                "micro": self.run.batch.micro_batch_size,
                "global": self.run.batch.global_batch_size,
                "grad_accum": self.grad_accum,
                "seq_length": self.run.batch.seq_length,
            },
            "train_steps": self.run.train_steps,
        }


def _resolve(base: Path, p: str) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else base / path


def plan_run(manifest_path: Path, world_size: int, verify: Verify = "size") -> RunPlan:
    """Load and check `run.json` for a job of `world_size` processes."""
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        raise UserError("no such run manifest", str(manifest_path))
    base, data = read_manifest_bytes(manifest_path)
    run = decode_manifest(data, str(manifest_path), kind="run")
    assert isinstance(run, RunManifest)
    where = str(manifest_path)

    init = None
    if run.model.init is not None:
        init = open_artifact(_resolve(base, run.model.init), "checkpoint", verify=verify)
    if (init is None) == (run.model.config is None):
        raise UserError("$.model: give exactly one of `init` (a checkpoint) or `config`", where)
    config = init.config if init is not None else run.model.config

    if not run.data.sources:
        raise UserError("$.data.sources: at least one tokens artifact is needed", where)
    sources = []
    for i, src in enumerate(run.data.sources):
        if src.weight <= 0:
            raise UserError(f"$.data.sources[{i}].weight: must be positive, got {src.weight}", where)
        path = _resolve(base, src.path)
        sources.append((path, open_artifact(path, "tokens", verify=verify), src.weight))

    p, b = run.parallel, run.batch
    dp = check_world(world_size, p.tp, p.pp, "$.parallel")
    if b.micro_batch_size < 1 or b.global_batch_size % (b.micro_batch_size * dp):
        raise UserError(
            f"$.batch.global_batch_size: {b.global_batch_size} is not a multiple of "
            f"micro_batch_size * dp = {b.micro_batch_size} * {dp}",
            where,
        )
    # The pipeline runs the whole per-rank batch as microbatches of `micro_batch_size`.
    microbatches = b.global_batch_size // (b.micro_batch_size * dp)
    stages = check_parallelism(
        config, Parallelism.from_run(p, run.precision, microbatches, run.compile), "$.parallel"
    )
    return RunPlan(
        path=manifest_path,
        run=run,
        config=config,
        init=init,
        data=sources,
        world_size=world_size,
        dp=dp,
        grad_accum=microbatches,
        stage_layers=stages,
    )
