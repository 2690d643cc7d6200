"""The planner's layout search: every tp x pp x cp x dp layout of N GPUs (and every ep of a mixture
of experts) with the least recompute that fits their memory (`megacore.planner.memory`), ranked by
expected throughput (`megacore.planner.throughput`).

Every candidate keeps the run's micro batch, global batch, precision, schedule (pipelines) and
sequence parallel; a layout the batch does not divide into is refused (`Dims.microbatches`). A
cp > 1 layout is listed only where it beats the same tp x pp with its cp ranks as dp ones (the same
state sharding): it fits where that one does not, or runs faster (say, more microbatches for a
pipeline's bubble). Every ep dividing dp and the experts is a candidate (FSDP2's dp mode).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.parallel.layout import RECOMPUTE, Dims, Parallelism, check_parallelism, check_sharding
from megacore.planner.memory import ALLOWANCE, TensorCache, fixed_bytes, peak_bytes, tensor_cache
from megacore.planner.throughput import GPUS_PER_NODE, relative_throughput


@dataclass(frozen=True)
class Candidate:
    """A layout of the GPUs: its peak rank's bytes and expected throughput, or why it is refused."""

    dims: Dims
    recompute: str
    microbatches: int
    peak: int  # bytes on the fullest rank, ALLOWANCE not included; 0 when refused
    throughput: float  # `relative_throughput`; 0 when refused or not fitting
    fits: bool
    reason: str = ""  # why it does not fit or is refused

    @property
    def label(self) -> str:
        return f"{self.dims.label}, recompute {self.recompute}"


def candidate_parallelism(base: Parallelism, dims: Dims, microbatches: int, recompute: str) -> Parallelism:
    """The run's settings in another layout: no pipeline settings without a pipeline, the run's
    per-stage layer counts only with its own pp."""
    spec = msgspec.structs.replace(base.spec, tp=dims.tp, cp=dims.cp, ep=dims.ep)
    if dims.pp == 1:
        spec = msgspec.structs.replace(spec, pp=1, pp_layers=None, schedule="1f1b", virtual_stages=1)
    else:
        spec = msgspec.structs.replace(
            spec, pp=dims.pp, pp_layers=spec.pp_layers if dims.pp == spec.pp else None
        )
    return dataclasses.replace(base, spec=spec, microbatches=microbatches, recompute=recompute)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(config: ModelConfig, base: Parallelism, gpus: int, seq: int | None) -> Iterator[Dims]:
    """Every layout of `gpus`: cp only where it can split `seq` (`Dims.check_seq_length`; any with
    None), ep > 1 for a mixture of experts whose experts and dp it divides (FSDP2's dp mode)."""
    experts = config.moe.num_experts if config.moe and base.spec.dp_mode == "fsdp" else None
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                if cp > 1 and seq is not None:
                    try:
                        Dims(tp, pp, cp, dp).check_seq_length(seq, base.spec.sequence_parallel)
                    except UserError:
                        continue
                for ep in _divisors(math.gcd(dp, experts)) if experts else [1]:
                    yield Dims(tp, pp, cp, dp, ep)


@dataclass(frozen=True)
class Search:
    """What every candidate of one search shares: the model, the run's settings and the GPUs."""

    config: ModelConfig
    base: Parallelism
    gpu_memory: int
    micro: int
    seq: int
    global_batch: int
    attention: str
    gpus_per_node: int
    tensors: TensorCache

    def candidate(self, dims: Dims) -> Candidate:
        """A layout with the least recompute that fits, or its largest peak, or why it is refused."""
        try:
            m = dims.microbatches(self.global_batch, self.micro, "global batch")
            par = candidate_parallelism(self.base, dims, m, "none")
            check_parallelism(self.config, par)
            check_sharding(self.config, par, dims)
        except UserError as e:
            return Candidate(dims, "-", 0, 0, 0.0, False, str(e))
        fixed = fixed_bytes(self.config, par, dims.dp, self.tensors(par))
        for recompute in RECOMPUTE:
            par = candidate_parallelism(self.base, dims, m, recompute)
            need = peak_bytes(self.config, par, fixed, self.micro, self.seq, self.attention)
            if need + ALLOWANCE <= self.gpu_memory:
                eff = relative_throughput(self.config, par, dims.dp, self.seq, self.gpus_per_node, self.micro)
                return Candidate(dims, recompute, m, need, eff, True)
        return Candidate(dims, recompute, m, need, 0.0, False, "does not fit")


def _rank(c: Candidate) -> tuple:
    """Fitting ones by throughput, then the others by their peak, the refused ones last."""
    return (not c.fits, -c.throughput, c.peak or math.inf)


def search(
    config: ModelConfig,
    base: Parallelism,
    gpus: int,
    gpu_memory: int,
    micro: int,
    seq: int,
    global_batch: int,
    attention: str = "sdpa",
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Candidate]:
    """Every layout of `gpus` (module docstring), the fitting ones first, best expected throughput
    first, then the others."""
    if gpus < 1:
        raise UserError(f"must be at least 1, got {gpus}", "--gpus")
    s = Search(
        config, base, gpu_memory, micro, seq, global_batch, attention, gpus_per_node, tensor_cache(config)
    )
    found = {dims: s.candidate(dims) for dims in layouts(config, base, gpus, seq)}

    def without_cp(d: Dims) -> Candidate:  # the same tp x pp with its cp ranks as dp ones
        return found[Dims(d.tp, d.pp, 1, d.dp * d.cp, d.ep)]

    out = [c for d, c in found.items() if d.cp == 1 or _rank(c) < _rank(without_cp(d))]
    return sorted(out, key=_rank)
