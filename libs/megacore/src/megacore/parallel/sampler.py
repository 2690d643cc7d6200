"""The sampler (`megacore.models.sampling`) on a `ParallelModel`: every rank runs the same prompts
through its part of the whole model with its own KV cache (a tensor-parallel rank caches its own
heads), the vocab shards of the logits gathered, and every rank draws the same tokens from the same
seed, so the completions are the same in every layout the sampler runs in: tp, dp (FSDP2 gathers
the weights as for any forward), ep. A pipeline, context parallel, sequence parallel, compiled
blocks and fp8 do not run it yet (`check_sampler_layout`: one line); there the `Generator`
(`parallel.generate`) serves samples and lm-eval with its forwards without a cache."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from megacore.errors import UserError
from megacore.models.lora import adapter_dropout_off
from megacore.models.sampling import Sampling, sample
from megacore.parallel.dims import Parallelism
from megacore.parallel.engine import ParallelModel


def _unsupported(par: Parallelism) -> str | None:
    """What of the layout `par` the sampler does not run under yet (None: it runs): a pipeline, cp
    and sequence parallel split what a rank's cache would hold; compiled blocks would compile again
    for every cache length, and float8 matmuls take no few-row inputs."""
    spec = par.spec
    checks = (
        ("pp", spec.pp > 1), ("cp", spec.cp > 1), ("sequence_parallel", spec.sequence_parallel),
        ("compile", par.compile), ("precision fp8", par.precision == "fp8"),
    )  # fmt: skip
    return next((name for name, on in checks if on), None)


def runs_sampler(par: Parallelism) -> bool:
    """Whether the sampler runs under the layout `par` (else the `Generator`'s forwards serve)."""
    return _unsupported(par) is None


def check_sampler_layout(par: Parallelism, where: str) -> None:
    """UserError naming what of the layout `par` the sampler cannot run under yet."""
    if (name := _unsupported(par)) is not None:
        raise UserError(f"the sampler runs a whole model on each rank: {name} is not supported yet", where)


def sample_parallel(
    pm: ParallelModel,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    sampling: Sampling = Sampling(),
    stop_ids: Collection[int] = (),
    where: str = "sampler",
    done: Callable[[int, list[int]], bool] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """Each prompt's completion, the same on every rank (a collective: every rank calls it alike);
    `done(row, ids so far)` ends a row early (lm-eval's stop sequences); `seeds`: each row's
    (`models.sampling.sample`)."""
    check_sampler_layout(pm.par, where)
    pm.refresh()

    def whole(logits: torch.Tensor) -> torch.Tensor:
        if pm.tp_mesh is None:
            return logits
        return DTensor.from_local(logits, pm.tp_mesh, [Shard(2)], run_check=False).full_tensor()

    with adapter_dropout_off(pm.parts):
        return sample(pm.parts[0], prompts, max_new, sampling, stop_ids, whole=whole, done=done, seeds=seeds)
