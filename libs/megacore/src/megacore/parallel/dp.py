"""Data parallel and mixed precision: FSDP2 over the replicas of every parameter (dp x cp, the
experts over edp x cp under expert parallel) or plain replication, and without either, bf16/fp16
compute copies of the fp32 parameters (`ComputeCopies`).

Which modules FSDP2 wraps is `layout.fsdp_unit`'s, the rule the planner counts their buffers by:
each block, a block's experts apart under expert parallel, then the stage itself (its embedding,
final norm and head). Whether FSDP2 is applied at all, or copies kept instead, is
`build_rules.fsdp_wrapped` / `build_rules.compute_copies`.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from megacore.models.nf4 import is_nf4
from megacore.parallel.layout import Dims, Parallelism, fsdp_dim, fsdp_unit

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def _policy(par: Parallelism) -> MixedPrecisionPolicy:
    """bf16/fp16 compute, fp32 master weights and gradient reduction; fp32 throughout otherwise."""
    dtype = COMPUTE_DTYPES.get(par.precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _units(model: nn.Module, dims: Dims) -> list[str]:
    """The modules FSDP2 wraps below the stage itself (`layout.fsdp_unit`), innermost first (FSDP2
    takes a child before its parent), then in layer order."""
    units = {fsdp_unit(name, dims) for name, _ in model.named_parameters()} - {""}
    return sorted(units, key=lambda u: (-u.count("."), int(u.split(".")[1])))


def apply_dp(
    model: nn.Module,
    data_mesh: DeviceMesh,
    par: Parallelism,
    dims: Dims,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 per unit and per stage over `data_mesh` (dp, or dp x cp flattened), or plain
    replication (`dp_mode` replicate). `experts_mesh` (expert parallel): edp (x cp), the experts'
    FSDP2 mesh; their gradients are divided by all the replicas, as every other gradient is
    (`parallel/ep.py`)."""
    mp = _policy(par)
    # Under tp the root's output is the vocab-sharded logits, a view of a DTensor's local tensor;
    # FSDP2 warns that an in-place op on it would skip its pre-backward hook. The loss reads it only.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    if par.spec.dp_mode == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=data_mesh, mp_policy=mp)
        return
    # With pipelining the parameters are needed again for backward after other microbatches.
    names = {id(p): n for n, p in model.named_parameters()}  # stage names are contract names
    placement = partial(_fsdp_placement, names)
    kw = {"mp_policy": mp, "reshard_after_forward": par.spec.pp == 1, "shard_placement_fn": placement}
    for unit in _units(model, dims):
        module = model.get_submodule(unit)
        if unit.endswith(".experts"):
            fully_shard(module, mesh=experts_mesh, **kw)
            module.set_gradient_divide_factor(dims.replicas)
            if experts_mesh.size() > 1:
                # A division after a plain sum: NCCL's PreMulSum, which a custom factor takes
                # otherwise, does not exist on gloo. (On a one-rank mesh torch 2.13 would then
                # divide twice; there it divides once without communicating.)
                module.set_force_sum_reduction_for_comms(True)
        else:
            fully_shard(module, mesh=data_mesh, **kw)
    fully_shard(model, mesh=data_mesh, **kw)


def _fsdp_placement(names: dict[int, str], param: nn.Parameter) -> Shard:
    tp_dims = [p.dim for p in getattr(param, "placements", ()) if isinstance(p, Shard) and p.dim > 0]
    return Shard(fsdp_dim(names[id(param)], param.shape, tp_dims[0] if tp_dims else None))


class ComputeCopies:
    """Mixed precision without data parallelism: the module computes with bf16/fp16 copies of its
    fp32 parameters, refreshed from them before each step, and each copy's gradient is added to its
    fp32 parameter's `.grad` as soon as autograd produces it, so microbatches accumulate in fp32.

    That is what FSDP2's MixedPrecisionPolicy (fp32 reduction) does, and on a one-rank mesh FSDP2
    did it through all-gather and reduce-scatter buffers that are pure copying: 26% of a bf16 step
    of a 125M Llama on CPU (2 threads, profiled). This costs one cast per parameter per step and one
    add per parameter per microbatch. The fp32 parameters, which the optimizer, clipping and
    checkpoints see, are `named`; the module holds the copies. A frozen parameter (LoRA's base) has
    its compute-dtype copy alone, in `named` too; an NF4 one (QLoRA's) is left as it is."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        named = list(module.named_parameters())
        copies: dict[int, nn.Parameter] = {}  # by id: a tied parameter gets one copy
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or is_nf4(p):  # QLoRA's NF4 base dequantizes to the input's dtype
                    continue
                if id(p) not in copies:
                    copy = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
                    if p.requires_grad:
                        copy.register_post_accumulate_grad_hook(partial(_add_grad, p))
                        self.pairs.append((p, copy))
                    copies[id(p)] = copy
                setattr(m, name, copies[id(p)])
        # A frozen base (LoRA) is never updated: it is held in the compute dtype alone, without an
        # fp32 master, and loaded into directly.
        self.named = [(n, p if p.requires_grad or id(p) not in copies else copies[id(p)]) for n, p in named]

    @torch.no_grad()
    def refresh(self) -> None:
        """The copies take the fp32 parameters' current values (after an optimizer step or a load)."""
        for p, copy in self.pairs:
            copy.copy_(p)


def _add_grad(param: nn.Parameter, copy: nn.Parameter) -> None:
    if param.grad is None:
        param.grad = copy.grad.to(param.dtype)
    else:
        param.grad.add_(copy.grad)
    copy.grad = None
