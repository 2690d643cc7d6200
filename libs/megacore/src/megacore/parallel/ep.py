"""Expert parallel: the experts of every MoE layer split over the `ep` ranks, tokens sent to their
experts' ranks and back with all-to-all (variable counts).

The ep ranks are data-parallel ranks (the mesh's dp is `edp` x `ep`, `mesh.build_mesh`): each routes
its own tokens. The stacked expert weights become DTensors sharded on dim 0 over ep, so rank r holds
experts [r·E/ep, (r+1)·E/ep) and a checkpoint's pieces say which (any layout reads any slice). The
model's `MoE` hands its `Experts` the rows grouped by expert; around that call the style applies
here hands the experts their local weights (the model has no parallel code) and sends each group
to the rank holding its expert (the counts first, one all-to-all of E numbers,
then the rows), regroups the rows it receives by its local expert, and after the experts' SwiGLU
sends the results back the same way, so `MoE` sees the rows it sent come back in its own order.
Backward runs the same all-to-alls the other way (`AllToAll`).

Under tensor parallel the experts are split over tp as well, each expert's ffn (gate/up on their
rows, down on its columns, `parts.moe.tp_dims`), so the weights are DTensors on the (ep, tp) mesh. Every
tp rank routes the same whole rows (the router is replicated; with sequence parallel the MoE's
input is gathered, `tp.apply_tp`), exchanges them with the same tp rank of the other ep ranks, and
runs its ffn slice: the down projection's partial sums are summed over tp before they go back
(backward: the rows' gradients are summed over tp instead), so the outputs, and the router's
gradient, are the same on every tp rank.

Gradients: an expert's gradient on its rank sums the contributions of every ep rank's tokens. FSDP2
shards experts over `edp` (x cp) only, so its reduction divides by the whole data-parallel size (dp x cp,
the engine's `replicas`) rather than edp's, as it divides every other gradient (engine.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

from megacore.config import ModelConfig
from megacore.models.moe import Experts, GroupedLinear
from megacore.parallel.tp import _SumGradOverGroup, _SumOverGroup
from megacore.parts import moe


class AllToAll(torch.autograd.Function):
    """Rows [N, ...] split by `send` (rows to each rank of `group`) -> the rows received, `recv`
    from each rank in rank order; backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _dispatch(module: Experts, args: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows grouped by global expert, counts [E]) -> (the rows for this rank's experts grouped by
    local expert, their counts [E/ep]); what `_combine` needs is kept on the module until then."""
    rows, counts = args
    ep, group = mesh.size(), mesh.get_group()
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)  # E/ep counts to each rank
    by_source = received.view(ep, local)  # [source rank, local expert]
    send, recv = counts.view(ep, local).sum(1).tolist(), by_source.sum(1).tolist()
    got = AllToAll.apply(rows, send, recv, group)  # ordered by (source, local expert)
    # Regroup by local expert (then source): a stable sort on each row's expert-major key.
    keys = torch.arange(ep * local, device=counts.device).view(ep, local)
    keys = (keys % local) * ep + keys // local
    order = torch.repeat_interleave(keys.flatten(), by_source.flatten()).argsort(stable=True)
    module._ep_state = (order, send, recv, group)
    return got.index_select(0, order), by_source.sum(0)


def _combine(module: Experts, out: torch.Tensor) -> torch.Tensor:
    """The experts' outputs back to the ranks the rows came from, in their order."""
    order, send, recv, group = module._ep_state
    del module._ep_state
    back = out.index_select(0, order.argsort())  # by (source, local expert) again
    return AllToAll.apply(back, recv, send, group)


def apply_ep(model: nn.Module, mesh: DeviceMesh, config: ModelConfig) -> None:
    """Split every MoE layer's experts of a Decoder (or a pipeline stage of one) over `mesh`: its
    `ep` dim (the experts) and its `tp` dim (each expert's ffn), either or both."""
    names = mesh.mesh_dim_names
    ep = mesh["ep"] if "ep" in names else None
    tp = mesh["tp"] if "tp" in names else None

    def shard(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, GroupedLinear):
            return
        for kind in ("weight", "bias"):
            if (param := getattr(module, kind)) is None:
                continue
            dim = moe.tp_dims(config, 1)[f"{moe.EXPERTS}{name}.{kind}"]  # the experts' own tp dims
            placements = [
                Shard(0) if n == "ep" else Replicate() if dim is None else Shard(dim) for n in names
            ]
            setattr(module, kind, nn.Parameter(distribute_tensor(param, mesh, placements)))

    def inputs(module: Experts, args: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts = _dispatch(module, args, ep) if ep is not None else args
        rows = _SumGradOverGroup.apply(rows, tp.get_group()) if tp is not None else rows
        # The experts this rank holds: its local shards (after FSDP2 has gathered them: its
        # pre-forward hook runs first), handed to `Experts.forward` with the rows; the down bias
        # joins after the sum over tp (`outputs`), once.
        projs = (module.gate_proj, module.up_proj, module.down_proj)
        biases = [None if p.bias is None else p.bias.to_local() for p in projs[:2]]
        module._ep_counts = counts
        return rows, counts, *(p.weight.to_local() for p in projs), *biases, None

    def outputs(module: Experts, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        out = _SumOverGroup.apply(out, tp.get_group()) if tp is not None else out
        counts, bias = module._ep_counts, module.down_proj.bias
        del module._ep_counts
        if bias is not None:  # this rank's experts' down biases, each over its rows
            out = out + bias.to_local().repeat_interleave(counts, dim=0, output_size=out.shape[0])
        return _combine(module, out) if ep is not None else out

    for module in model.modules():
        if isinstance(module, Experts):
            distribute_module(module, mesh, shard, inputs, outputs)
