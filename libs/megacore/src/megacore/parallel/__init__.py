"""Parallelism on PyTorch's own engine (docs/architecture.md): the mesh's sizes and the engine's
settings (`dims`), the layout and its checks (`layout`), how a stage is built (`build_rules`; these
three without torch), the device mesh (`mesh`), tensor/sequence parallel styles (`tp`), context parallel
(`cp`), the engine that builds a rank's stages and runs a step (`engine`), saving / loading a live
model (`checkpoint_io`). The planner that sizes them is `megacore.planner`.

Only the torch-free `dims` and `layout` are imported here: a dry run uses them without torch.
"""

from megacore.parallel.dims import MULTI_STAGE, SCHEDULES, Dims, Parallelism, check_microbatches
from megacore.parallel.layout import (
    ADAMW_STATE_KINDS,
    OPTIM_PREFIX,
    TensorPlace,
    check_parallelism,
    check_tp,
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
    "optim_state_name",
    "place",
    "split_optim_name",
    "stage_layers",
    "stage_of",
    "tp_box",
]
