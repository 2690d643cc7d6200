"""The sizes of a job's mesh (`Dims`) and what the engine builds over them (`Parallelism`): the
one owner of the mesh's arithmetic and the layout's settings, torch-free (docs/architecture.md).
Where each tensor lives for these sizes, and the checks that refuse an impossible layout, are
`layout.py`'s; how the engine builds a stage for them, `build_rules.py`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import get_args

from megacore.artifacts.header import FLOAT_DTYPES
from megacore.artifacts.run_spec import ParallelSpec, Schedule
from megacore.config import LoRA, RouterLosses
from megacore.errors import UserError


def check_positive(value: int, what: str, where: str) -> None:
    """A size that must be at least 1."""
    if value < 1:
        raise UserError(f"{what} must be at least 1, got {value}", where)


@dataclass(frozen=True)
class Dims:
    """The sizes of a job's mesh and the one owner of their arithmetic, torch-free (torchtitan's
    `ParallelDims`): the engine, the checkpoint pieces, the run plan and the planner all read it.

    Ranks run (pp, dp, cp, tp), tp fastest (`mesh.build_mesh`); under expert parallel dp is made of
    (edp, ep), ep inner. Parameters are replicated over dp and cp alike, so a tensor has
    dp x cp `replicas`, which FSDP2 shards over (dp x cp flattened: `replica`)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1

    @classmethod
    def for_world(
        cls, world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, where: str = "world size"
    ) -> Dims:
        """dp = world / (tp x pp x cp): the world a multiple of tp x pp x cp, and dp of ep (expert
        parallel's ranks are data-parallel ranks)."""
        if world % (tp * pp * cp):
            sizes = f"tp*pp = {tp}*{pp}" if cp == 1 else f"tp*pp*cp = {tp}*{pp}*{cp}"
            raise UserError(f"world size {world} is not a multiple of {sizes}", where)
        dp = world // (tp * pp * cp)
        if dp % ep:
            raise UserError(f"ep {ep} does not divide dp {dp} (world {world} / tp*pp*cp)", where)
        return cls(tp, pp, cp, dp, ep)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters (dp x cp): what FSDP2 shards them over."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """The data-parallel ranks holding the same experts under expert parallel."""
        return self.dp // self.ep

    @property
    def experts_replicas(self) -> int:
        """The ranks holding the same experts under expert parallel (edp x cp): what FSDP2 shards
        them over."""
        return self.edp * self.cp

    def experts_replica(self, replica: int) -> int:
        """A rank's index among the `experts_replicas` (edp rank x cp + cp rank, FSDP2's flattened
        mesh) from its index among the `replicas`."""
        dp_rank, cp_rank = divmod(replica, self.cp)
        return dp_rank // self.ep * self.cp + cp_rank

    def replica(self, dp_rank: int, cp_rank: int) -> int:
        """A rank's index among the `replicas`: dp rank x cp + cp rank (FSDP2's flattened mesh)."""
        return dp_rank * self.cp + cp_rank

    def rank(self, pp_rank: int, replica: int, tp_rank: int) -> int:
        """The global rank at those coordinates (`replica`: dp and cp together)."""
        return (pp_rank * self.replicas + replica) * self.tp + tp_rank

    def seq_multiple(self, sequence_parallel: bool) -> int:
        """What a seq_length must be a multiple of: context parallel cuts each sequence into 2 x cp
        equal chunks (`megacore.parallel.cp`) and sequence parallel each cp rank's part into tp;
        anything without cp."""
        if self.cp == 1:
            return 1
        return math.lcm(2 * self.cp, self.cp * self.tp) if sequence_parallel else 2 * self.cp

    def check_seq_length(
        self, seq_length: int, sequence_parallel: bool, where: str = "$.parallel.cp"
    ) -> None:
        """`seq_length` splits as `seq_multiple` says."""
        check_positive(self.cp, "cp", where)
        if seq_length % self.seq_multiple(sequence_parallel) == 0:
            return
        if seq_length % (2 * self.cp):
            raise UserError(
                f"cp {self.cp} splits each sequence into {2 * self.cp} equal chunks: seq_length "
                f"{seq_length} is not a multiple of {2 * self.cp}",
                where,
            )
        raise UserError(
            f"sequence parallel splits each cp rank's {seq_length // self.cp} tokens over tp "
            f"{self.tp}: choose a seq_length that divides",
            where,
        )

    def microbatches(self, global_batch: int, micro: int, where: str = "$.batch.global_batch_size") -> int:
        """The batch rule: a step's global batch is micro batch x dp x the microbatches each dp rank
        runs (a pipeline's, or gradient accumulation's)."""
        if global_batch % (micro * self.dp):
            raise UserError(
                f"{global_batch} is not a multiple of micro_batch_size * dp = {micro} * {self.dp}", where
            )
        return global_batch // (micro * self.dp)

    @property
    def label(self) -> str:
        """'tp 2 x pp 1 x dp 4'; 'tp 2 x pp 1 x cp 4 x dp 1' with context parallel (the mesh's order);
        'tp 1 x pp 2 x dp 8 (ep 8)' with expert parallel, ep ranks being dp ranks."""
        cp = f"cp {self.cp} x " if self.cp > 1 else ""
        return f"tp {self.tp} x pp {self.pp} x {cp}dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")


def check_microbatches(batch_size: int, microbatches: int, where: str = "batch") -> int:
    """An uneven split hangs a pipeline schedule, so it is refused before starting."""
    check_positive(microbatches, "microbatches", where)
    if batch_size % microbatches:
        raise UserError(f"{microbatches} microbatches do not divide the batch of {batch_size}", where)
    return batch_size // microbatches


# --- the engine's layout -------------------------------------------------------------------------

SCHEDULES: tuple[str, ...] = get_args(Schedule)
MULTI_STAGE = ("interleaved1f1b", "interleavedzb", "zbv")  # several stages per pipeline rank
# Zero-bubble schedules set weight gradients themselves (no autograd hooks): compute copies cannot
# catch them, so without dp these keep FSDP2's mixed precision.
ZERO_BUBBLE = ("interleavedzb", "zbv")


PRECISIONS = (*FLOAT_DTYPES.values(), "fp8")  # as a run manifest holds them: fp32, bf16, fp16, fp8
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Parallelism:
    """What the engine builds: a run manifest's `parallel` section, and from the rest of the run
    its precision, the microbatches of one step, whether blocks are compiled, what is recomputed
    and the attention kernel. dp is the job's (`dims`): what is left of the world."""

    spec: ParallelSpec = field(default_factory=ParallelSpec)
    precision: str = "bf16"  # bf16 or fp16 compute with fp32 master weights and reductions, or fp32
    microbatches: int = 1  # per step: a pipeline's microbatches, or gradient accumulation without one
    compile: bool = False  # torch.compile each transformer block
    recompute: str = "none"  # activation recompute: none, selective (attention core), full (per block)
    fp8_scaling: str = "tensorwise"  # precision fp8: tensorwise or rowwise (megacore.parallel.fp8)
    attention: str = "auto"  # the attention kernel: auto, sdpa or flash (`models.attention`)
    fp8_emulate: bool = False  # precision fp8 emulated (`fp8.float8_emulation`: tests only)
    lora: LoRA | None = None  # adapters trained on a frozen base (`megacore.models.adapters`)
    packed_pairs: bool = False  # preference pairs packed: each row's sides summed apart (`fused_loss`)
    router: RouterLosses = field(default_factory=RouterLosses)  # a mixture of experts' training settings

    def dims(self, dp: int) -> Dims:
        """The mesh's sizes: this layout's with `dp` data-parallel ranks."""
        s = self.spec
        return Dims(tp=s.tp, pp=s.pp, cp=s.cp, dp=dp, ep=s.ep)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds: `virtual_stages` for the interleaved schedules, 2 for zbv."""
        if self.spec.schedule == "zbv":
            return 2
        return self.spec.virtual_stages if self.spec.schedule in MULTI_STAGE else 1

    def rank_stages(self, pp_rank: int) -> list[int]:
        """Stage indices held by pipeline rank `pp_rank`: looped for interleaved, V-shaped for zbv."""
        if self.spec.schedule == "zbv":
            return [pp_rank, 2 * self.spec.pp - 1 - pp_rank]
        return [pp_rank + k * self.spec.pp for k in range(self.stages_per_rank)]
