"""float8 training, `precision: "fp8"`: bf16 compute (as "bf16": fp32 master weights, bf16 compute
copies or FSDP2's bf16 policy) whose transformer blocks' linears (q/k/v/o, gate/up/down) run
their three matmuls (forward, input gradient, weight gradient) in float8 through torchao's float8
training (`Float8Linear`), with `tensorwise` scaling (one scale per tensor, the fastest) or
`rowwise` (one per row, closer to bf16). The output layer, the embedding, the norms, a mixture of
experts' router and experts stay in bf16 (the router's choices and the vocab's logits are where
float8's rounding would matter most). Parameters are untouched, so checkpoints are those of a bf16
run: a run resumes in bf16 and exports as usual.

On a GPU float8 matmuls need compute capability 8.9 or newer (Ada, Hopper, Blackwell):
`float8_emulation` is the one decision, made once per process (the run's start checks, a dry run's
too) and handed to the engine in `Parallelism.fp8_emulate`; a GPU without them is refused, never
emulated silently, and the engine checks again (`check_float8_matmuls`) when it is told not to
emulate. torchao's emulation (float8 rounding with bf16 matmuls) runs anywhere and is what the CPU
tests use, with MEGA_FP8_EMULATE=1 (`megacore.env`).

Under tensor parallel torchao's float8 styles replace the plain ones for these linears
(`tp_styles`): tensorwise only, which layout.check_parallelism holds. Under FSDP2 with tensorwise
scaling the weights are all-gathered in float8 (`build_rules.float8_all_gather`: half bf16's bytes), their
scales worked out for every weight at once before each step (`precompute_scales`, one all-reduce
of the amaxes instead of one a weight); rowwise scaling gathers bf16, as torchao supports no more.
torchao is an optional dependency, imported only here.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from megacore import env
from megacore.errors import UserError
from megacore.parallel.build_rules import float8_weight


def float8_emulation(where: str) -> bool:
    """Whether precision fp8 is emulated in this process: when asked (MEGA_FP8_EMULATE=1, tests
    only), else never: a GPU with float8 matmuls runs them, anything else is a UserError."""
    if importlib.util.find_spec("torchao") is None:
        raise UserError("$.precision: fp8 needs torchao, which is not installed (pip install torchao)", where)
    if env.flag("MEGA_FP8_EMULATE"):
        return True
    check_float8_matmuls(where)
    return False


def check_float8_matmuls(where: str) -> None:
    """A GPU with float8 matmuls here (compute capability 8.9 or newer), else a UserError."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise UserError(
            "$.precision: fp8 needs a GPU with float8 matmuls (compute capability 8.9 or newer: Ada, "
            "Hopper, Blackwell) and this machine has none; use bf16",
            where,
        )


def _block_linear(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and float8_weight(f"{name}.weight", module.weight.shape)


def apply_fp8(model: nn.Module, scaling: str, emulate: bool, all_gather: bool = False) -> None:
    """Swap a Decoder's (or a stage's) block linears for torchao's Float8Linear, in place, before
    tensor parallel and FSDP2 wrap them; the Decoder was built with its projections unfused
    (`build_rules.fast_paths`), so that every matmul goes through its Float8Linear. `emulate`:
    `float8_emulation`'s decision. `all_gather` (`build_rules.float8_all_gather`): their weights become
    torchao's tensors that FSDP2 all-gathers in float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(scaling)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, module_filter_fn=_block_linear, config=config)


def precompute_scales(module: nn.Module) -> None:
    """The float8 scales of every weight FSDP2 all-gathers in float8, from their current values in
    one all-reduce (after an optimizer step or a load, before the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)


def is_float8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def tp_styles() -> tuple[type, type]:
    """torchao's (colwise, rowwise) tensor-parallel styles for Float8Linear modules."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel
