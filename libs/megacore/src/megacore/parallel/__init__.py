"""Parallelism on PyTorch's own engine: layout planning and checks (`plan`), the device mesh
(`mesh`), tensor/sequence parallel plans, pipeline stages and schedules, data parallel wrapping."""

from megacore.parallel.plan import (
    ADAMW_STATE_KINDS,
    OPTIM_PREFIX,
    TensorPlace,
    check_layout,
    check_microbatches,
    check_tp,
    check_world,
    kv_replicated,
    optim_state_name,
    padded_vocab,
    place,
    split_optim_name,
    stage_layers,
    stage_of,
)

__all__ = [
    "ADAMW_STATE_KINDS",
    "OPTIM_PREFIX",
    "TensorPlace",
    "check_layout",
    "check_microbatches",
    "check_tp",
    "check_world",
    "kv_replicated",
    "optim_state_name",
    "padded_vocab",
    "place",
    "split_optim_name",
    "stage_layers",
    "stage_of",
]
