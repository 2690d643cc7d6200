"""How the engine builds and wraps a stage for a layout: the rules `engine.py` applies and the
planner counts (which loss is fused, which modules FSDP2 wraps, compute copies, the Decoder's fast
paths, which weights run float8, QLoRA's NF4 base), torch-free."""

from __future__ import annotations

from collections.abc import Sequence

from megacore.config import is_block_projection
from megacore.parallel.dims import ZERO_BUBBLE, Dims, Parallelism


def compute_copies(par: Parallelism, dims: Dims) -> bool:
    """Whether the engine keeps bf16/fp16 compute copies of the fp32 parameters (`ComputeCopies`):
    mixed precision without replicas (dp x cp), but for the zero-bubble schedules."""
    return par.precision != "fp32" and dims.replicas == 1 and par.spec.schedule not in ZERO_BUBBLE


def fsdp_wrapped(par: Parallelism, dims: Dims) -> bool:
    """Whether the engine applies FSDP2 (or replicate): with replicas (dp x cp), or mixed precision
    without copies."""
    return dims.replicas > 1 or (par.precision != "fp32" and not compute_copies(par, dims))


def fused_loss(par: Parallelism) -> bool:
    """The loss is fused with the output projection (`Decoder(tokens, targets)`: no full fp32
    logits) without tp and without a pipeline; otherwise the logits are vocab-parallel or sent. Not
    for packed preference pairs either: the fused loss sums whole rows, not a row's sides."""
    return par.spec.tp == 1 and par.spec.pp * par.stages_per_rank == 1 and not par.packed_pairs


def fast_paths(par: Parallelism) -> dict[str, bool]:
    """The Decoder's single-device fast paths (`models.layers.FastPaths`), where every tensor they
    see is a whole plain one: the hidden norms' hand-written backward but on sequence-parallel
    shards, the per-head q/k norms' but under tp (DTensor heads), q/k/v and gate/up as one matmul
    each but under tp (each rank holds a slice of every projection), fp8 (each Float8Linear runs
    its own matmuls) or LoRA's frozen base (the concatenated weights would be one more copy of
    them, saved for backward in every block: 197 MB a microbatch for a 125M Llama in fp32, and
    no faster; an NF4 base dequantizes each weight in its own matmul)."""
    tp = par.spec.tp
    return {
        "norms": not (par.spec.sequence_parallel and tp > 1),
        "head_norms": tp == 1,
        "projections": tp == 1 and par.precision != "fp8" and par.lora is None,
    }


# precision fp8: the weights whose linears run float8 matmuls (megacore.parallel.fp8) are the blocks'
# projections (`config.is_block_projection`); float8 matmul kernels need both dims a multiple of 16.
FLOAT8_DIM_MULTIPLE = 16


def float8_weight(name: str, shape: Sequence[int]) -> bool:
    """Whether precision fp8 runs this weight's (checkpoint name, shape) matmuls in float8."""
    return is_block_projection(name) and all(d % FLOAT8_DIM_MULTIPLE == 0 for d in shape)


def float8_all_gather(par: Parallelism, dims: Dims) -> bool:
    """Whether FSDP2 all-gathers the float8 weights in float8 (half bf16's bytes): fp8 with
    tensorwise scaling (torchao supports no other), sharded over the replicas (dp x cp)."""
    return (
        par.precision == "fp8"
        and par.fp8_scaling == "tensorwise"
        and dims.replicas > 1
        and par.spec.dp_mode == "fsdp"
    )


def nf4_base(par: Parallelism) -> bool:
    """Whether the run is QLoRA's: its frozen base's projections stored in NF4 (`models.nf4`)."""
    return par.lora is not None and par.lora.base_dtype == "nf4"
