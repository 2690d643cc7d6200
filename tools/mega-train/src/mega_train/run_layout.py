"""A run's layout, without torch: the mesh's sizes for a world size, the microbatches of a step
and each pipeline stage's layers (`check_layout`), and the settings the engine builds the run's
model with (`parallelism`), the same on every rank.
"""

from __future__ import annotations

from mega_train.objectives import kind_of
from megacore.artifacts import RunManifest
from megacore.config import LoRA, ModelConfig, RouterLosses
from megacore.errors import UserError
from megacore.parallel.layout import Dims, Parallelism, check_parallelism, check_tp


def check_layout(
    run: RunManifest, config: ModelConfig, world_size: int, where: str
) -> tuple[Dims, int, list]:
    """The mesh's sizes, the microbatches of a step and each stage's layers, for this world size."""
    b, par = run.batch, run.parallel
    check_tp(config, par.tp, f"{where}: $.parallel.tp")  # before the world: the more basic mistake
    dims = Dims.for_world(world_size, par.tp, par.pp, par.cp, par.ep, f"{where}: $.parallel")
    dims.check_seq_length(b.seq_length, par.sequence_parallel, f"{where}: $.parallel.cp")
    # One step runs the rank's share of the batch as microbatches of `micro_batch_size`.
    microbatches = dims.microbatches(
        b.global_batch_size, b.micro_batch_size, f"{where}: $.batch.global_batch_size"
    )
    par = parallelism(run, microbatches)
    try:
        par.router.check(config)
    except ValueError as e:
        raise UserError(str(e), where) from None
    stages = check_parallelism(config, par, f"{where}: $.parallel")
    return dims, microbatches, stages


def parallelism(
    run: RunManifest, microbatches: int, fp8_emulate: bool = False, lora: LoRA | None = None
) -> Parallelism:
    """The engine's layout settings of a run whose step has `microbatches` microbatches per rank."""
    return Parallelism(
        run.parallel,
        run.precision,
        microbatches,
        run.compile is True,
        run.recompute,
        run.fp8_scaling,
        run.attention,
        fp8_emulate,
        lora,
        packs_pairs(run),
        router_losses(run),
    )


def router_losses(run: RunManifest) -> RouterLosses:
    """A mixture of experts' training settings: the run manifest's `model.router_*`."""
    m = run.model
    return RouterLosses(m.router_aux_loss_coef, m.router_z_loss_coef, m.router_bias_update)


def packs_pairs(run: RunManifest) -> bool:
    """Whether a preference run packs whole pairs into each row (`"packing": "pack"`)."""
    return kind_of(run).pairs and run.data.packing == "pack"
