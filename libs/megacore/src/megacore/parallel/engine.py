"""Builds this rank's part of the model for a (pp, dp, cp, tp) mesh and runs forward/backward.

Only building and running happens here: what to build (stages, layers, schedule, checks, the mesh's
sizes: `Dims`) is decided by `layout`, which needs no processes. Order (torchtitan's): the stage
modules are built on the meta device from the layer ModuleDict with everything they do chosen then
(attention kernel, recompute, the fast paths `build_rules.fast_paths` allows), float8 linears swapped in
(`fp8.apply_fp8`, precision fp8), tensor parallel is applied, then context parallel (`cp.apply_cp`),
then expert parallel (`ep.apply_ep`: the experts over ep and tp), then data parallel (`dp.apply_dp`:
FSDP2 per block and per stage over dp, or dp x cp with cp, a block's experts first over edp (x cp)
under ep; or `replicate`; without either, bf16/fp16 compute copies instead: `ComputeCopies`), then the
parameters are materialised with `to_empty` and filled by the caller
(`megacore.parallel.checkpoint_io.load_checkpoint`, or `init_weights`). Pipeline stages are
`PipelineStage`s built by hand; schedules are chosen by name.

One `forward_backward` takes this rank's whole batch of a step and runs it as `par.microbatches`
microbatches: the pipeline schedule's, or gradient accumulation without a pipeline (gradient
reduction over dp only after the last one). Either way the gradients are those of the mean loss
over the counted targets (not IGNORE) of the whole global batch: each microbatch's summed loss is
weighted by dp x cp / count (data parallel averages the gradients over its ranks, and over cp's,
whose parts of the rows each give part of the gradient). Under cp every rank gets its dp share of
whole rows and keeps its part of each (`_local`); the loss it returns is the whole rows'. Nothing
is read back to the host: the counts, the weight and the loss stay device tensors (`Step`), so a
GPU runs the step without waiting for it. `evaluate` runs the same microbatches forward only, and
can hand each one's full-vocab logits to a callback (evaluation metrics). What a microbatch's
loss is comes in as an argument of both (`losses.Loss`: language modelling's token cross entropy by
default, a loss over each sequence's summed log-probability, `row_sums.RowSums`, or an objective's
own), so the engine names no objective. A mixture of experts' router losses and statistics are
`router_balance.RouterBalance`'s.

Tied embeddings under pipeline parallel: the last stage's copy of the embedding (`tied_copy`, never
saved), its gradient summed with the embedding's after each backward (`tied.TiedEmbeddings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megacore.config import ModelConfig, is_block_projection
from megacore.models import adapters, nf4
from megacore.models.attention import document_ids
from megacore.models.lora import adapter_dropout_off, add_lora, freeze_base
from megacore.models.moe import MoE
from megacore.parallel.build_rules import (
    compute_copies,
    fast_paths,
    float8_all_gather,
    fsdp_wrapped,
    fused_loss,
    nf4_base,
)
from megacore.parallel.cp import apply_cp, gather_sequence, shard_sequence
from megacore.parallel.dims import MULTI_STAGE, SCHEDULES, Parallelism, check_microbatches
from megacore.parallel.dp import COMPUTE_DTYPES, ComputeCopies, apply_dp
from megacore.parallel.ep import apply_ep
from megacore.parallel.fp8 import apply_fp8, check_float8_matmuls, precompute_scales
from megacore.parallel.layout import check_parallelism
from megacore.parallel.losses import Loss, Microbatch
from megacore.parallel.mesh import dp_mesh, experts_replicas_mesh, replicas_mesh
from megacore.parallel.pieces import box_slice, local_piece
from megacore.parallel.router_balance import RouterBalance
from megacore.parallel.tied import TiedEmbeddings
from megacore.parallel.tp import apply_tp, distribute_adapters, loss_context

# torch.distributed.pipelining's classes by name, imported when a pipeline is built: the package
# (and torch._dynamo, which it imports) adds about 0.9 s to the start of every process without one.
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
assert set(SCHEDULE_CLASSES) == set(SCHEDULES)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # of activations sent between stages


@dataclass
class Step:
    """What `forward_backward` hands back, on the device: the mean loss over this rank's counted
    targets (None on ranks without the last stage) and, for a mixture of experts, the step's
    router statistics over every rank (`RouterBalance.report`)."""

    loss: torch.Tensor | None
    moe: dict[str, torch.Tensor] | None = None


class ParallelModel:
    """This rank's stages of the model, and one pipeline/forward-backward step over a batch."""

    def __init__(
        self, config: ModelConfig, par: Parallelism, mesh: DeviceMesh, device: torch.device | str
    ) -> None:
        self.config, self.par, self.mesh = config, par, mesh
        self.device = torch.device(device)
        self.layers = check_parallelism(config, par)
        self.num_stages = len(self.layers)
        self.dims = par.dims(dp_mesh(mesh).size())
        self.dp = self.dims.dp
        if par.precision == "fp8" and not par.fp8_emulate:
            check_float8_matmuls("precision")  # never emulated unless asked
        self.tp_mesh = mesh["tp"] if par.spec.tp > 1 else None
        self.cp_mesh = mesh["cp"] if par.spec.cp > 1 else None
        self.ep_mesh = mesh["ep"] if par.spec.ep > 1 else None
        # A mixture of experts' experts split over ep and tp (`ep.apply_ep`), either or both.
        split = tuple(d for d, n in (("ep", par.spec.ep), ("tp", par.spec.tp)) if n > 1)
        self.experts_mesh = mesh[split] if split and config.moe is not None else None
        # Parameters are replicated over dp and cp alike; FSDP2 shards them over both.
        self.data_mesh = replicas_mesh(mesh, par.spec.cp)
        self.stage_ids = par.rank_stages(mesh["pp"].get_local_rank())
        self.float8_gather = float8_all_gather(par, self.dims)
        self.fused_loss = fused_loss(par)
        self.copies: list[ComputeCopies] = []
        self.parts: list[nn.Module] = [self._build_stage(s) for s in self.stage_ids]
        self.schedule = self._build_schedule() if self.num_stages > 1 else None
        # The model's MoE layers (the others dense), this rank's by global index.
        moe_layers = {
            int(i): block.mlp
            for part in self.parts
            for i, block in part.layers.items()
            if isinstance(block.mlp, MoE)
        }
        self.router = RouterBalance(config, par.router, moe_layers, par.spec.tp, self.dims.replicas)
        # Language modelling's loss, `forward_backward`'s and `evaluate`'s unless given another.
        self.token_loss = Loss(config.vocab_size, self.tp_mesh)
        named = dict(self._named_all())
        tied = config.tie_embeddings and self.num_stages > 1
        self.tied_copy: nn.Parameter | None = named.get("lm_head.weight") if tied else None
        self._tied = (
            TiedEmbeddings(named.get("embed.weight"), self.tied_copy, mesh, par, self.num_stages)
            if tied
            else None
        )
        # Called before each microbatch of an unpipelined step with its index: the process's
        # allocator may hand back what the last one freed (mega_train.allocator).
        self.before_microbatch: Callable[[int], None] | None = None
        self._batch_targets: torch.Tensor | None = None  # this step's, which microbatches are views of

    @property
    def replicas(self) -> int:
        return self.dims.replicas

    def _build_stage(self, s: int) -> nn.Module:
        """Stage `s` of the model, built and parallelised in the module docstring's order."""
        from megacore.models.decoder import Decoder
        from megacore.models.layers import FastPaths

        config, par = self.config, self.par
        with torch.device("meta"):
            part = Decoder(
                config,
                layers=self.layers[s],
                embed=s == 0,
                head=s == self.num_stages - 1,
                attention=par.attention,
                recompute=par.recompute,
                fast=FastPaths(**fast_paths(par)),
            )
        if par.precision == "fp8":  # before tp: its styles for Float8Linear are torchao's
            apply_fp8(part, par.fp8_scaling, par.fp8_emulate, self.float8_gather)
        if self.tp_mesh is not None:
            apply_tp(part, self.tp_mesh, config, par.spec.sequence_parallel, par.precision == "fp8")
        if par.lora is not None:  # after tp: its styles stay the linears', the adapters placed apart
            self._add_adapters(part, s)
        if self.cp_mesh is not None:
            apply_cp(part, self.cp_mesh)
        if self.experts_mesh is not None:
            apply_ep(part, self.experts_mesh, config)
        if par.lora is not None:  # after every plan that makes parameters anew (ep's experts)
            freeze_base(part)
        if nf4_base(par):  # before FSDP2, whose shards are then NF4 shards
            nf4.quantize_base(part, [n.removesuffix(".weight") for n, _ in part.named_parameters()
                                     if is_block_projection(n)])  # fmt: skip
        if par.compile:  # after TP (the graphs trace DTensors), before FSDP (its hooks stay outside)
            part.compile_blocks()
        if fsdp_wrapped(par, self.dims):
            experts = experts_replicas_mesh(self.mesh, par.spec.cp) if self.ep_mesh is not None else None
            apply_dp(part, self.data_mesh, par, self.dims, experts)
        part.to_empty(device=self.device)
        nf4.materialize(part)
        if compute_copies(par, self.dims):
            self.copies.append(ComputeCopies(part, COMPUTE_DTYPES[par.precision]))
        return part

    def _add_adapters(self, part: nn.Module, s: int) -> None:
        """Stage `s`'s LoRA adapters on the meta device, placed over tp."""
        lora = self.par.lora
        with torch.device("meta"):
            names = adapters.modules(self.config, lora.targets, self.layers[s])
            add_lora(part, names, lora.rank, lora.scale, lora.dropout)
        if self.tp_mesh is not None:
            distribute_adapters(part, self.tp_mesh, self.config)

    def _build_schedule(self):
        """The pipeline schedule over this rank's stages."""
        from torch.distributed.pipelining import PipelineStage, schedules

        group = self.mesh["pp"].get_group()
        stages = [
            PipelineStage(part, s, self.num_stages, self.device, group=group)
            for part, s in zip(self.parts, self.stage_ids, strict=True)
        ]
        cls = getattr(schedules, SCHEDULE_CLASSES[self.par.spec.schedule])
        first = stages if self.par.spec.schedule in MULTI_STAGE else stages[0]
        # The loss is weighted (the step's scale over the count, not the microbatch count: grads
        # are summed): scaling the gradients afterwards would miss the fp32 parameters behind
        # `ComputeCopies`. Each call gives the schedule its own loss (`_scheduled`).
        return cls(
            first, n_microbatches=self.par.microbatches, loss_fn=self._microbatch_loss, scale_grads=False
        )

    def _microbatch_loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        weight: float = 1.0,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        loss: Loss | None = None,
        mb: Microbatch | None = None,
    ) -> torch.Tensor:
        """The last stage's loss of a microbatch from its logits: its summed `loss` times `weight`
        (the scale of fp16 loss scaling, dp / count: `forward_backward`), `on_logits` called first if
        given. Under a pipeline `mb` is worked out from `targets` (a view of the batch's rows)."""
        if on_logits is not None:
            self._report(logits, targets, on_logits)
        mb = mb if mb is not None else Microbatch(self._microbatch(targets), None, targets)
        return (loss or self.token_loss).of_logits(mb, logits) * weight

    def refresh(self) -> None:
        """Before a step or an evaluation: the compute copies, and the float8 weights' scales for
        FSDP2's float8 all-gather, from the fp32 parameters' current values."""
        for copies in self.copies:
            copies.refresh()
        if self.float8_gather:
            for part in self.parts:
                precompute_scales(part)

    def _named_all(self) -> Iterator[tuple[str, nn.Parameter]]:
        if self.copies:
            for copies in self.copies:
                yield from copies.named
            return
        for part in self.parts:
            yield from part.named_parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Checkpoint tensor names (the contract's) and this rank's parameters (DTensor or plain)
        as a checkpoint holds them: without a tied output copy."""
        for name, p in self._named_all():
            if p is not self.tied_copy:
                yield name, p

    def loaded_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(checkpoint tensor name, parameter) for every parameter filled from a checkpoint (or
        initialised): `named_parameters`, and a tied output copy from `embed.weight`."""
        yield from self.named_parameters()
        if self.tied_copy is not None:
            yield "embed.weight", self.tied_copy

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter the optimizer updates: a tied output copy included."""
        for _, p in self._named_all():
            yield p

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def reports_logits(self) -> bool:
        """Whether `evaluate` calls its `on_logits` here: on the last stage at tp and cp rank 0, so
        once per dp rank."""
        return self.has_last and all(
            m is None or m.get_local_rank() == 0 for m in (self.tp_mesh, self.cp_mesh)
        )

    def forward_backward(
        self,
        tokens: torch.Tensor | None,
        targets: torch.Tensor | None,
        scale: float = 1.0,
        positions: torch.Tensor | None = None,
        count: torch.Tensor | int | None = None,
        loss: Loss | None = None,
    ) -> Step:
        """Forward and backward over this rank's batch (its dp share) as `par.microbatches`
        microbatches; the gradients of `scale` times the mean `loss` (language modelling's unless
        given: `losses.Loss`) over the global batch's `count` (counted targets, or what `loss`
        counts: a device tensor or a known number) are accumulated in the parameters (`count`
        None: every dp rank counts as many as this one). `positions` [B, S]: packed documents
        (`Decoder.forward`), given on every rank, a pipeline's middle stages included. Returns the
        mean loss (unscaled) over this rank's count on ranks holding the last stage, and a mixture
        of experts' router statistics: device tensors, nothing read back."""
        n, loss = self.par.microbatches, loss or self.token_loss
        data = tokens if tokens is not None else targets
        if data is not None:  # middle pipeline stages get no batch; the ends check it
            check_microbatches(data.shape[0], n, "microbatches")
        counted = self._count(loss, targets, positions)
        # Gradient reduction averages over the replicas (dp x cp), so each rank's share is
        # weighted up by them.
        weight = _weight(self.replicas * scale, count if count is not None else self.dp * counted)
        tokens, targets, inputs = self._local(tokens, targets, positions)
        self._batch_targets = targets
        self.refresh()
        self.router.weigh(scale / n)
        with loss_context(self.tp_mesh):
            if self.schedule is None:
                losses = []
                for i, (x, y, kw) in enumerate(_chunks(n, tokens, targets, inputs)):
                    if self.before_microbatch is not None:
                        self.before_microbatch(i)
                    self._grad_sync(i == n - 1)
                    summed = self._loss(Microbatch(i, x, y, kw), loss)
                    (summed * weight).backward()
                    losses.append(summed.detach())
                mean = self._mean(losses, counted, loss)
            else:
                losses = self._scheduled(
                    self.schedule.step, tokens, targets, inputs, weight=weight, loss=loss
                )
                if self.config.tie_embeddings and self.par.lora is None:  # LoRA: both frozen
                    self._tied.sum_grads()
                mean = self._mean(losses, counted, loss, weight) if self.has_last else None
        return Step(mean, self.router.report(n, self.device))

    def evaluate(
        self,
        tokens: torch.Tensor | None,
        targets: torch.Tensor | None,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        positions: torch.Tensor | None = None,
        loss: Loss | None = None,
    ) -> torch.Tensor | None:
        """Forward only over this rank's batch: the mean `loss` (language modelling's unless given)
        over its count on ranks holding the last stage.

        `on_logits(logits, targets)` (give it on every rank: tp gathers the logits) is called where
        `reports_logits`, once per microbatch, with its logits [b, s, vocab_size] over the whole
        vocab (gathered over tp, vocab padding columns dropped; in the compute precision)."""
        n = self.par.microbatches
        self.refresh()
        # Compiled blocks over DTensors fail without autograd (torch 2.13: "'Tensor' object has no
        # attribute '_local_tensor'"), so there autograd stays on; nothing calls backward.
        grad = self.par.compile and self.tp_mesh is not None
        with adapter_dropout_off(self.parts), torch.set_grad_enabled(grad), loss_context(self.tp_mesh):
            loss = loss or self.token_loss
            counted = self._count(loss, targets, positions)
            tokens, targets, inputs = self._local(tokens, targets, positions)
            self._batch_targets = targets
            if self.schedule is None:
                chunks = enumerate(_chunks(n, tokens, targets, inputs))
                losses = [self._loss(Microbatch(i, x, y, kw), loss, on_logits) for i, (x, y, kw) in chunks]
                return self._mean(losses, counted, loss)
            if self.par.spec.schedule == "zbv":
                last = partial(self._microbatch_loss, on_logits=on_logits, loss=loss)
                losses = self.forward_stages(_chunks(n, tokens, targets, inputs), last)
            else:
                losses = self._scheduled(
                    self.schedule.eval, tokens, targets, inputs, on_logits=on_logits, loss=loss
                )
            return self._mean(losses, counted, loss) if self.has_last else None

    @torch.no_grad()
    def microbatch_logits(self, mb: Microbatch) -> torch.Tensor:
        """This rank's logits [b, s, V_local] of a microbatch's tokens as the loss sees them (its part
        of the rows under cp, its vocab shard under tp), without autograd: a frozen model's forward
        beside another's microbatch, in the same layout (one stage: no pipeline)."""
        return self.parts[0](mb.tokens, **mb.inputs)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward only over rows `tokens` [b, s], the same on every rank (generation, scoring): their
        logits [b, s, vocab_size] over the whole vocab in fp32 where `reports_logits`, else None.
        One microbatch through the stages in turn (`forward_stages`: any shape, every layout), the
        rows padded on the right to the multiple of their length the layout splits (cp's chunks,
        sequence parallel's shards), which changes no earlier position's logits; LoRA's dropout off."""
        s, got = tokens.shape[1], []
        tokens = F.pad(tokens, (0, -s % self.dims.seq_multiple(self.par.spec.sequence_parallel)))
        self.refresh()
        grad = self.par.compile and self.tp_mesh is not None  # as `evaluate`
        with adapter_dropout_off(self.parts), torch.set_grad_enabled(grad):
            chunk = self._local(tokens, torch.zeros_like(tokens), None)  # targets: `_report` gathers them too
            self.forward_stages([chunk], lambda out, y: self._report(out, y, lambda lg, _: got.append(lg)))
        return got[0][:, :s].float() if got else None

    def _local(
        self, tokens: torch.Tensor | None, targets: torch.Tensor | None, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """This rank's tokens and targets, and what every stage takes besides its input (packed
        documents' positions; their document ids too under cp, worked out on the whole row). Each
        rank reads these from the batch (a schedule splits keyword inputs into microbatches and
        hands them to every stage) rather than receiving them from the previous stage."""
        if self.cp_mesh is None:
            return tokens, targets, ({} if positions is None else {"positions": positions})
        cp, rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
        inputs = {}
        if positions is not None:
            segments = document_ids(positions)
            inputs = {
                "positions": shard_sequence(positions, cp, rank),
                "segments": shard_sequence(segments, cp, rank),
            }
        return shard_sequence(tokens, cp, rank), shard_sequence(targets, cp, rank), inputs

    def _count(
        self, loss: Loss, targets: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """What this rank's mean divides by (`Loss.count`; 0 where it holds no targets)."""
        if targets is None:
            return torch.zeros((), dtype=torch.int64, device=self.device)
        return loss.count(targets, positions)

    def _mean(
        self,
        losses: list[torch.Tensor],
        counted: torch.Tensor,
        loss: Loss,
        weight: torch.Tensor | float = 1.0,
    ) -> torch.Tensor:
        """The mean loss over this rank's `counted` from microbatches' summed losses (each times
        `weight`); a token loss's row parts summed over the cp ranks (a row loss is whole rows')."""
        total = torch.stack([x.detach().float() for x in losses]).sum() / weight
        if self.cp_mesh is not None and loss.per_token:
            dist.all_reduce(total, group=self.cp_mesh.get_group())
        return total / counted.clamp(min=1)

    def _scheduled(
        self,
        call: Callable[..., object],
        tokens: torch.Tensor | None,
        targets: torch.Tensor | None,
        inputs: dict[str, torch.Tensor],
        **loss_inputs: object,
    ) -> list[torch.Tensor]:
        """One call of the pipeline schedule (`step` or `eval`), its loss given `loss_inputs`
        (`_microbatch_loss`'s weight, on_logits, loss); the last stage's microbatch losses (else empty).
        torch's schedules take their loss function when built and call it with (output, target)
        only, so the call's inputs are bound here, for this call alone."""
        self.schedule._loss_fn = partial(self._microbatch_loss, **loss_inputs)
        args = (tokens,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        try:
            call(*args, **kwargs, **inputs)
        finally:
            self.schedule._loss_fn = self._microbatch_loss
        return losses

    def forward_stages(
        self, chunks: Iterable[tuple], last: Callable[[torch.Tensor, torch.Tensor], object]
    ) -> list:
        """Forward only through the stages in order, a microbatch (`_chunks`'s) at a time, plain
        send/recv of any shape between pipeline ranks (torch's ZBV runtime needs a backward, its
        schedules keep the shapes first seen); `last(output, targets)` of each, on the last stage."""
        pp = self.mesh["pp"]
        group, me = pp.get_group(), pp.get_local_rank()
        owner = {s: r for r in range(pp.size()) for s in self.par.rank_stages(r)}
        parts = dict(zip(self.stage_ids, self.parts, strict=True))
        losses = []
        for x, y, kw in chunks:
            for s in sorted(parts):
                if s > 0 and owner[s - 1] != me:  # the shape and dtype first: middle ranks hold no batch
                    meta = torch.zeros(4, dtype=torch.int64, device=self.device)
                    dist.recv(meta, group=group, group_src=owner[s - 1])
                    x = torch.empty(meta[:3].tolist(), dtype=_DTYPES[int(meta[3])], device=self.device)
                    dist.recv(x, group=group, group_src=owner[s - 1])
                x = parts[s](x, **kw)
                if s == self.num_stages - 1:
                    losses.append(last(x, y))
                elif owner[s + 1] != me:
                    x = x.contiguous()
                    meta = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], device=self.device)
                    dist.send(meta, group=group, group_dst=owner[s + 1])
                    dist.send(x, group=group, group_dst=owner[s + 1])
        return losses

    def _loss(
        self,
        mb: Microbatch,
        loss: Loss,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """A microbatch's summed loss without a pipeline: fused with the output projection where the
        layout allows (`build_rules.fused_loss`: not when the logits are vocab-parallel, tp's `lm_loss`
        under `loss_parallel`), the loss takes it (`Loss.fused`) and the logits are not wanted
        (`on_logits`)."""
        model = self.parts[0]
        if self.fused_loss and on_logits is None and loss.fused is not None:
            return loss.of_fused(mb, model(mb.tokens, mb.targets, reduction=loss.fused, **mb.inputs))
        logits = model(mb.tokens, **mb.inputs)
        return self._microbatch_loss(logits, mb.targets, on_logits=on_logits, loss=loss, mb=mb)

    def _microbatch(self, targets: torch.Tensor) -> int:
        """Which microbatch of this rank's batch `targets` are (they are a view of its rows)."""
        batch = self._batch_targets
        row = (targets.data_ptr() - batch.data_ptr()) // (batch.stride(0) * batch.element_size())
        return row // targets.shape[0]

    def _report(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """`on_logits` with the whole vocab and sequence: the tp ranks' shards gathered (and the cp
        ranks' parts), padding columns dropped."""
        if self.tp_mesh is not None:
            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(2)], run_check=False).full_tensor()
        if self.cp_mesh is not None:
            group, cp = self.cp_mesh.get_group(), self.cp_mesh.size()
            logits, targets = (gather_sequence(t.detach(), group, cp) for t in (logits, targets))
        if self.reports_logits:
            on_logits(logits[..., : self.config.vocab_size].detach(), targets)

    def _grad_sync(self, on: bool) -> None:
        """Reduce gradients over dp in this backward (the last microbatch's) or not yet."""
        if self.dp > 1:
            for part in self.parts:
                part.set_requires_gradient_sync(on)

    @torch.no_grad()
    def init_weights(
        self, std: float = 0.02, seed: int = 0, only: Callable[[str], bool] | None = None
    ) -> None:
        """Fresh weights, the same as a single-process `Decoder.init_weights(std, seed)`'s: each
        rank draws a whole tensor and keeps its slice. `only`: the names to fill (LoRA: the
        adapters), else all."""
        from megacore.models.decoder import initial_value

        for name, p in self.loaded_parameters():
            if only is not None and not only(name):
                continue
            offset, shape, local = local_piece(p)
            whole = initial_value(name, tuple(p.shape), self.config, std, seed)
            if nf4.is_nf4(local):  # quantized whole, as the loader does (`nf4.fill`)
                nf4.fill(p, whole, offset, shape)
            elif local.numel():
                local.copy_(box_slice(whole, (offset, shape)))


def _weight(numerator: float, count: torch.Tensor | int) -> torch.Tensor | float:
    """numerator / count (at least 1): each microbatch's summed loss's weight. Worked out in
    float64 and rounded to float32 once, as a Python float is where `count` is known."""
    if isinstance(count, torch.Tensor):
        return (numerator / count.clamp(min=1).double()).float()
    return numerator / max(count, 1)


def _chunks(
    n: int, tokens: torch.Tensor | None, targets: torch.Tensor | None, inputs: dict[str, torch.Tensor]
):
    """The microbatches: (tokens, targets, stage inputs) each; None where this rank has no batch."""
    xs = tokens.chunk(n) if tokens is not None else [None] * n
    ys = targets.chunk(n) if targets is not None else [None] * n
    parts = {k: v.chunk(n) for k, v in inputs.items()}
    return ((x, y, {k: v[i] for k, v in parts.items()}) for i, (x, y) in enumerate(zip(xs, ys, strict=True)))
