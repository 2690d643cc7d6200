"""The sampler (`megacore.models.sampling`) on a `ParallelModel`: every rank runs the same prompts
through its part of the model with its own KV cache (a tensor-parallel rank caches its own heads, a
pipeline rank its stages' layers), one forward a token through the stages in turn
(`ParallelModel.forward_stages`), the vocab shards of the last stage's logits gathered; its ranks
draw the tokens from the seeds and hand them to the other stages, so the completions are the same
on every rank and in every layout the sampler runs in: tp, pp, dp (FSDP2 gathers the weights as for
any forward), ep. Context parallel, sequence parallel, compiled blocks and fp8 do not run it yet
(`check_sampler_layout`: one line); there the `Generator` (`parallel.generate`) serves samples and
lm-eval with its forwards without a cache."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from megacore.errors import UserError
from megacore.models.kv_cache import KVCache
from megacore.models.lora import adapter_dropout_off
from megacore.models.sampling import Sampling, decode
from megacore.parallel.dims import Parallelism
from megacore.parallel.engine import ParallelModel


def _unsupported(par: Parallelism) -> str | None:
    """What of the layout `par` the sampler does not run under yet (None: it runs): cp and sequence
    parallel split the rows a rank's cache would hold; compiled blocks would compile again for
    every cache length, and float8 matmuls take no few-row inputs."""
    spec = par.spec
    checks = (
        ("cp", spec.cp > 1), ("sequence_parallel", spec.sequence_parallel),
        ("compile", par.compile), ("precision fp8", par.precision == "fp8"),
    )  # fmt: skip
    return next((name for name, on in checks if on), None)


def runs_sampler(par: Parallelism) -> bool:
    """Whether the sampler runs under the layout `par` (else the `Generator`'s forwards serve)."""
    return _unsupported(par) is None


def check_sampler_layout(par: Parallelism, where: str) -> None:
    """UserError naming what of the layout `par` the sampler cannot run under yet."""
    if (name := _unsupported(par)) is not None:
        raise UserError(f"the sampler does not run under {name} yet", where)


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
    vocab, last = pm.config.vocab_size, pm.num_stages - 1
    pp = pm.mesh["pp"]
    drawer = next(r for r in range(pp.size()) if last in pm.par.rank_stages(r))

    def head(logits: torch.Tensor, _) -> torch.Tensor:  # the last stage's: the whole vocab's
        if pm.tp_mesh is not None:
            logits = DTensor.from_local(logits, pm.tp_mesh, [Shard(2)], run_check=False).full_tensor()
        return logits[:, -1, :vocab]

    def forward(ids: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        got = pm.forward_stages([(ids, None, {"cache": cache})], head)
        return got[0] if got else None

    def agree(chosen: torch.Tensor) -> torch.Tensor:  # the drawing stage's tokens, on every stage
        if pp.size() > 1:
            dist.broadcast(chosen, group=pp.get_group(), group_src=drawer)
        return chosen

    with adapter_dropout_off(pm.parts):
        return decode(forward, prompts, max_new, pm.device, sampling, stop_ids, 0, done, seeds, agree)
