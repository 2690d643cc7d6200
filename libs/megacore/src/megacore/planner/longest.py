"""The planner's longest-sequence search: per layout and recompute, the longest seq_length (a
multiple of what the layout splits a sequence by: `Dims.seq_multiple`) whose fullest rank fits the
GPU's memory (`megacore.planner.memory`). Every term of the memory model grows with the sequence,
so a bisection finds it (up to MAX_SEQ)."""

from __future__ import annotations

from dataclasses import dataclass

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.parallel.layout import RECOMPUTE, Dims, Parallelism, check_parallelism
from megacore.planner.memory import ALLOWANCE, fixed_bytes, peak_bytes, tensor_cache
from megacore.planner.search import candidate_parallelism, layouts
from megacore.planner.throughput import GPUS_PER_NODE, relative_throughput

MAX_SEQ = 1 << 24  # where the search for the longest sequence stops (16,777,216 tokens)


def longest_sequence(
    config: ModelConfig, par: Parallelism, dp: int, micro: int, gpu_memory: int, attention: str = "sdpa"
) -> int:
    """The longest seq_length, a multiple of `Dims.seq_multiple`, at which the fullest rank of
    `par` fits `gpu_memory` with ALLOWANCE; 0 when not even the shortest fits, MAX_SEQ (rounded up
    to the multiple) when that does."""
    check_parallelism(config, par)
    fixed = fixed_bytes(config, par, dp, tensor_cache(config)(par))
    return _longest(config, par, fixed, micro, gpu_memory, attention)


def _longest(
    config: ModelConfig,
    par: Parallelism,
    fixed: list[int],
    micro: int,
    gpu_memory: int,
    attention: str,
    too_long: int | None = None,
) -> int:
    """`longest_sequence` from `fixed_bytes`: a bisection, the peak growing with the sequence.
    `too_long`: a seq_length known not to fit (a multiple of the step), the search's bound."""
    step = par.dims(1).seq_multiple(par.spec.sequence_parallel)

    def fits(k: int) -> bool:
        return peak_bytes(config, par, fixed, micro, k * step, attention) + ALLOWANCE <= gpu_memory

    limit = -(-MAX_SEQ // step)  # the first multiple at or past MAX_SEQ
    if not fits(1):
        return 0
    if too_long is None:  # double until one does not fit: fits(lo), not fits(hi)
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, 2 * hi
        if hi > limit:
            if fits(limit):
                return limit * step
            hi = limit
    else:
        lo, hi = 1, min(too_long // step, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


@dataclass(frozen=True)
class Longest:
    """A layout of the GPUs and the longest sequence each recompute fits (0: none)."""

    dims: Dims
    microbatches: int
    seq: dict[str, int]  # by recompute: none, selective, full
    throughput: float  # `relative_throughput` at the longest sequence, recompute full

    @property
    def label(self) -> str:
        return self.dims.label


def longest_sequences(
    config: ModelConfig,
    base: Parallelism,
    gpus: int,
    gpu_memory: int,
    micro: int,
    global_batch: int,
    attention: str = "sdpa",
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Longest]:
    """Every layout of `gpus` the batch divides into (`search.layouts`), longest sequence first (full
    recompute's; then the faster at it); the run's micro batch, global batch and other settings."""
    out, tensors = [], tensor_cache(config)
    for dims in layouts(config, base, gpus, None):
        try:
            m = dims.microbatches(global_batch, micro)
            pars = {r: candidate_parallelism(base, dims, m, r) for r in RECOMPUTE}
            check_parallelism(config, pars["full"])
        except UserError:  # the batch does not divide, fewer microbatches than stages, ...
            continue
        fixed = fixed_bytes(config, pars["full"], dims.dp, tensors(pars["full"]))
        full = _longest(config, pars["full"], fixed, micro, gpu_memory, attention)
        # Full recompute saves the least: no other fits a sequence it does not.
        too_long = full + dims.seq_multiple(base.spec.sequence_parallel)
        seq = {
            r: _longest(config, pars[r], fixed, micro, gpu_memory, attention, too_long) if full else 0
            for r in RECOMPUTE
            if r != "full"
        }
        eff = relative_throughput(config, pars["full"], dims.dp, full, gpus_per_node, micro) if full else 0.0
        out.append(Longest(dims, m, seq | {"full": full}, eff))
    return sorted(out, key=lambda c: (-c.seq["full"], -c.throughput))
