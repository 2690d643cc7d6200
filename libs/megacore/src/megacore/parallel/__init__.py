"""Parallelism on PyTorch's own engine (docs/architecture.md): the layout and its checks
(`layout`, no torch), the device mesh (`mesh`), tensor/sequence parallel styles (`tp`), context parallel
(`cp`), the engine that builds a rank's stages and runs a step (`engine`), saving / loading a live
model (`checkpoint_io`). The planner that sizes them is `megacore.planner`.

Only `layout` is imported here: a dry run uses it without importing torch.
"""

from megacore.parallel.layout import (
    ADAMW_STATE_KINDS,
    MULTI_STAGE,
    OPTIM_PREFIX,
    SCHEDULES,
    Dims,
    Parallelism,
    TensorPlace,
    check_microbatches,
    check_parallelism,
    check_tp,
    kv_replicated,
    optim_state_name,
    place,
    split_optim_name,
    stage_layers,
    stage_of,
    tp_box,
)

__all__ = [
    "ADAMW_STATE_KINDS",
    "MULTI_STAGE",
    "OPTIM_PREFIX",
    "SCHEDULES",
    "Dims",
    "Parallelism",
    "TensorPlace",
    "check_microbatches",
    "check_parallelism",
    "check_tp",
    "kv_replicated",
    "optim_state_name",
    "place",
    "split_optim_name",
    "stage_layers",
    "stage_of",
    "tp_box",
]
