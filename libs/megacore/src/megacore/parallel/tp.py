"""Tensor and sequence parallel as DTensor styles, applied to a plain Decoder.

Each module's style follows from where the layout places its weight (`layout.place`, the one
placement table): split on dim 0 is colwise (q/k/v/gate/up, the lm_head), on dim 1 rowwise
(o/down), the embedding split on its vocab rows is a vocab-parallel embedding, and the loss is a
vocab-parallel cross entropy (`loss_parallel`). With sequence parallel
the residual stream is a DTensor sharded on the sequence dim between blocks, norms run on their
sequence shard (SequenceParallel) and each attention / MLP input is all-gathered once. Every norm
takes these styles, Gemma's sandwich norms on the attention / MLP outputs and its (1 + w) RMSNorm
(plain ops, which DTensors take as they are) included.

Fewer kv heads than tp (multi-query Falcon 7B, or GQA with tp a multiple of the kv heads): k/v are
replicated, each rank keeps the kv head its query heads use, and the k/v output gradients are summed
over tp so the replicated weights get the full gradient. Per-head q/k norms (qk_norm) act on each
rank's own heads with a replicated weight whose gradient DTensor sums over tp (`HeadNorm`).
Attention sinks, a logit per q head, are split like q's heads (`HeadSplit`), as linear attention's
per-head parameters are.

A stage's boundaries are always plain tensors: hidden states in and out ([B, S/tp, H] with sequence
parallel, [B, S, H] without) and the local vocab shard of the logits, so pipeline stages send plain
tensors.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from megacore.config import ModelConfig
from megacore.models.decoder import LatentAttention
from megacore.models.layers import HeadWeights
from megacore.models.moe import GroupedLinear, MoE
from megacore.parallel.layout import place


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over a process group. Needed for
    correctness, not speed: each tp rank slices its kv heads out of a replicated projection, so
    the replicated weight's gradient is the sum of every rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward over a process group; identity backward: partial sums (each rank's
    part of a row-split product) made whole, whose consumers then hold the same gradient everywhere."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ReplicatedKV(ParallelStyle):
    """k or v projection replicated over tp; the output keeps the kv heads of this rank's q heads."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        kv_index = rank * self.num_kv_heads // tp  # tp is a multiple of the kv heads (checked)
        hd, multi = self.head_dim, self.num_kv_heads > 1
        group = device_mesh.get_group()

        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def inputs(mod, args, mesh):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Replicate()])
            else:
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *args[1:])

        def outputs(mod, out, mesh):
            local = _SumGradOverGroup.apply(out.to_local(), group)
            return local[..., kv_index * hd : (kv_index + 1) * hd] if multi else local

        return distribute_module(module, device_mesh, partition, inputs, outputs)


class HeadNorm(ParallelStyle):
    """A per-head norm inside attention (qk_norm's q_norm / k_norm) on this rank's heads.

    Its input is a plain [B, S, local heads, head_dim] tensor and each rank normalises its own heads
    with the whole (replicated) weight, so the forward needs nothing; but each rank's heads give
    only part of the weight's gradient. So the weight is a replicated DTensor and the input is
    viewed as sharded on the heads dim for the norm alone: DTensor's backward then leaves the
    weight a partial (summed over tp) gradient, as it does a sequence-parallel norm's, which
    the optimizer, clipping and FSDP2 already reduce. Where k/v are replicated (fewer kv heads than
    tp) several ranks hold the same k head; their parts are still what sums to the gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def inputs(mod, args, mesh):
            return (DTensor.from_local(args[0], mesh, [Shard(2)], run_check=False), *args[1:])

        def outputs(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)


class HeadSplit(ParallelStyle):
    """A tensor split by heads (`layers.HeadWeights`: attention sinks, linear attention's decay
    parameters and convolution filters) on its first dim like q: the module gives this rank's
    heads' part as a plain tensor, whose gradient is this shard's own."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]))

        def outputs(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, device_mesh, partition, output_fn=outputs)


def _linear_styles(module: nn.Module, float8: bool) -> tuple[type, type]:
    """(colwise, rowwise) styles for `module`: torchao's for a Float8Linear, else torch's."""
    if float8:
        from megacore.parallel import fp8

        if fp8.is_float8(module):
            return fp8.tp_styles()
    return ColwiseParallel, RowwiseParallel


def _to_local_hook(module, args, out):
    return out.to_local() if isinstance(out, DTensor) else out


def _to_local_copy_hook(module, args, out):
    # An inner stage's hidden states under SP: zero-bubble schedules detach a stage's outputs in
    # place, which a view (what to_local returns) refuses; a copy of one activation is cheap.
    return out.to_local().clone() if isinstance(out, DTensor) else out


LATENT = ("attn.q_a_proj", "attn.q_a_norm", "attn.kv_a_proj", "attn.kv_a_norm")


def _style(name: str, module: nn.Module, config: ModelConfig, tp: int, sp: bool, float8: bool):
    """The style of one module with a weight, from where `place` puts its weight (None: none)."""
    hidden_layout = Shard(1) if sp else Replicate()
    dim = place(f"{name}.weight", config, tp).tp_dim
    colwise, rowwise = _linear_styles(module, float8)
    if isinstance(module, nn.Embedding) and dim == 0:  # vocab-parallel: rowwise over the rows
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=hidden_layout, use_local_output=not sp
        )
    if isinstance(module, nn.Linear) and dim == 0:
        if name == "lm_head":  # logits stay sharded on the vocab for the vocab-parallel loss
            return colwise(input_layouts=hidden_layout, output_layouts=Shard(-1), use_local_output=True)
        return colwise()
    if isinstance(module, nn.Linear) and dim == 1:
        if ".mlp.shared_expert." in name:  # inside the MoE, which takes and gives whole plain rows
            return rowwise(output_layouts=Replicate(), use_local_output=True)
        return rowwise(output_layouts=hidden_layout, use_local_output=not sp)
    if isinstance(module, HeadWeights):
        return HeadSplit()
    if isinstance(module, GroupedLinear) or name.endswith(("mlp.router", "mlp.shared_expert_gate")):
        return None  # experts: split by `ep.apply_ep` (over tp too); the router and gate replicated
    if name.endswith(LATENT):
        return None  # latent attention's latent projections and norms: whole on every rank
    if isinstance(module, nn.Linear) and name.endswith(("k_proj", "v_proj")):
        return ReplicatedKV(config.num_heads, config.num_kv_heads, config.head_dim)
    if name.endswith(("attn.q_norm", "attn.k_norm", "attn.norm")):  # on heads, never on a sequence shard
        # (linear attention's output norm, "attn.norm", is per head too)
        return HeadNorm()
    if isinstance(module, nn.LayerNorm | nn.RMSNorm) and dim is None:
        return SequenceParallel() if sp else None
    raise NotImplementedError(f"no tensor-parallel style for {name} placed on dim {dim}")


def _check_plain(name: str, module: nn.Module) -> None:
    """A module DTensor shards reach needs its plain code: one built with a single-device fast path
    (`build_rules.fast_paths` decides them when the Decoder is built) is a programming error here."""
    if getattr(module, "fused", False):
        raise RuntimeError(f"{name} was built with a fused fast path; tensor parallel needs the plain one")


def _gather_block_inputs(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sequence parallel: gather the sequence once per attention / MLP input (a mixture of experts
    takes and gives whole plain rows: `ep.apply_ep`; latent attention takes them, its latent
    projections being plain)."""
    parallelize_module(
        block.attn,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=isinstance(block.attn, LatentAttention),
        ),
    )
    moe = isinstance(block.mlp, MoE)
    parallelize_module(
        block.mlp,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=moe
        ),
    )
    if moe:
        parallelize_module(
            block.mlp,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False
            ),
        )


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    config: ModelConfig,
    sequence_parallel: bool = False,
    float8: bool = False,
) -> None:
    """Parallelize a Decoder (or a pipeline stage of one) in place over `tp_mesh`; it was built
    without the fast paths tp cannot take (`build_rules.fast_paths`). `float8`: its block linears are
    torchao's Float8Linear (`fp8.apply_fp8`), which take torchao's styles."""
    sp, tp = sequence_parallel, tp_mesh.size()
    for name, module in list(model.named_modules()):
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        style = _style(name, module, config, tp, sp, float8)
        if isinstance(style, SequenceParallel | HeadNorm):  # norms on sharded sequences or heads
            _check_plain(name, module)
        if style is not None:
            parallelize_module(module, tp_mesh, style)
    for name, block in model.layers.items():  # each rank holds a slice of every projection
        if isinstance(block.attn, LatentAttention):  # its shared rotated k: every rank's heads use it
            block.attn.shared_rope.register_forward_hook(partial(_sum_grad_hook, tp_mesh.get_group()))
        _check_plain(f"layers.{name}.attn", block.attn)
        _check_plain(f"layers.{name}.mlp", block.mlp)
        if sp:
            _gather_block_inputs(block, tp_mesh)
    if model.embed is None and sp:
        # A later pipeline stage receives its sequence shard as a plain tensor.
        model.register_forward_pre_hook(
            lambda mod, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:])
        )
    if model.norm is not None and model.lm_head is None:
        model.norm.register_forward_hook(partial(_replicate_norm_out, tp_mesh))
    # Stage outputs are plain: the local vocab shard of the logits, or the local hidden states.
    model.register_forward_hook(_to_local_hook if model.norm is not None else _to_local_copy_hook)


def distribute_adapters(model: nn.Module, tp_mesh: DeviceMesh, config: ModelConfig) -> None:
    """A stage's LoRA adapters (attached after `apply_tp`) as DTensors placed as `layout.place`
    says; their linear's hooks then compute B A x on its DTensor input, and its output style
    reduces or keeps the sum of both parts as it did the linear's alone."""
    tp = tp_mesh.size()
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] not in ("lora_A", "lora_B"):
            continue
        dim = place(f"{name}.weight", config, tp).tp_dim
        layout = [Replicate() if dim is None else Shard(dim)]
        module.weight = nn.Parameter(distribute_tensor(module.weight, tp_mesh, layout))


def _sum_grad_hook(
    group: dist.ProcessGroup, module: nn.Module, args: tuple, out: torch.Tensor
) -> torch.Tensor:
    return _SumGradOverGroup.apply(out, group)


def _replicate_norm_out(tp_mesh: DeviceMesh, mod: nn.Module, args: tuple, out: torch.Tensor) -> DTensor:
    """Tied embeddings: logits = x @ embed.weight^T with the vocab-sharded embedding, so the final
    norm's output must be a replicated DTensor (gathered over the sequence with SP)."""
    if isinstance(out, DTensor):
        return out.redistribute(placements=[Replicate()])
    return DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)


def lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    tp_mesh: DeviceMesh | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Next-token cross entropy over `targets` [B, S] from logits [B, S, V_local]: the mean (or the
    sum) over the targets that are not IGNORE (-100, F.cross_entropy's ignore_index).

    With tp > 1 the logits are this rank's vocab shard and the loss is the vocab-parallel cross
    entropy; call it (and backward) inside `loss_context(tp_mesh)`. Columns beyond `vocab_size`
    (vocab padding) are masked out, so padding never takes probability mass.
    """
    tp = tp_mesh.size() if tp_mesh is not None else 1
    local_v = logits.shape[-1]
    start = (tp_mesh.get_local_rank() * local_v) if tp > 1 else 0
    logits = logits.float()
    if start + local_v > vocab_size:
        cols = torch.arange(start, start + local_v, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    flat_t = targets.reshape(-1)
    if tp == 1:
        return F.cross_entropy(logits.reshape(-1, local_v), flat_t, reduction=reduction)
    dt = DTensor.from_local(logits, tp_mesh, [Shard(2)], run_check=False)
    loss = F.cross_entropy(dt.flatten(0, 1), flat_t, reduction=reduction)
    return loss.to_local()


def loss_context(tp_mesh: DeviceMesh | None):
    """`loss_parallel()` when the logits are vocab-sharded, else a no-op context."""
    import contextlib

    return loss_parallel() if tp_mesh is not None and tp_mesh.size() > 1 else contextlib.nullcontext()
