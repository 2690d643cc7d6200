"""mega-train's training loop, top to bottom: set up, resume or start, step, report, save.

Every rank runs this with the same checked `RunPlan`. A step takes global batch `step` of the train
samples (`megacore.data.Dataset`: the sequence depends on the seed and the data only), gives this
rank its dp share, and runs it through `ParallelModel.forward_backward` as microbatches; the loss of
the step is the mean over all its tokens. Then one small all-reduce brings every rank the same
loss and the same stop request, the gradients are unscaled (fp16), their global norm is taken and
clipped, and the update is applied only when loss and norm are finite. A step that is not applied
still counts (its batch is consumed): Megatron's convention, and what keeps resumes exact.
Every `eval.every` steps and after the last one, the valid batches are evaluated (`evaluation.py`);
rank 0 writes each record to metrics.jsonl and, when configured, to W&B (`wandb_run.py`).

Faults: SIGTERM or SIGUSR1 ask for a checkpoint at the next step boundary and an exit 0; a
non-finite step follows `nan.policy`; checkpoints are atomic (`checkpoints.py`). Test hooks:
`MEGA_TRAIN_INJECT="nan-grad@3,nan-loss@5,kill@7,kill-in-save@4"` poisons a gradient or the loss
of a step, SIGKILLs the job in the middle of a step (after backward, before the update), or in the
middle of writing a checkpoint (after the shard files, before the manifest).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mega_train import __version__
from mega_train.allocator import configure_allocator
from mega_train.checkpoints import PRODUCER, check_resumable, newest, point_latest, prune, step_dir
from mega_train.evaluation import EvalSums
from mega_train.metrics import MetricsLog, eval_line, memory_gb, peak_tflops, perplexity, say, train_line
from mega_train.plan import RUN_MARK, RunPlan
from mega_train.wandb_run import WandbLog
from megacore.artifacts.manifest import OptimizerSpec, TrainingState
from megacore.artifacts.reader import parent_of
from megacore.config import flops_per_token
from megacore.data.dataset import Batch, Dataset
from megacore.data.packing import IGNORE, inputs_and_targets
from megacore.errors import Silent, UserError
from megacore.parallel.engine import ParallelModel, clip_grad_norm
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, device_type, shutdown
from megacore.parallel.state import load_checkpoint, load_rank_state, save_checkpoint
from megacore.progress import Progress


class Halted(UserError):
    """The run stopped itself (nan.policy halt): exit 1, the last checkpoint left as it was."""

    exit_code = 1


@dataclass
class State:
    """What a checkpoint's `training` section restores, besides weights and moments."""

    step: int = 0
    optimizer_steps: int = 0
    loss_scale: float | None = None
    counters: dict[str, int] = field(default_factory=lambda: {"skipped": 0, "nan_steps": 0, "scale_good": 0})
    metrics: dict[str, float] = field(default_factory=dict)  # the last train_loss, valid_loss


def lr_at(step: int, opt: OptimizerSpec, total: int) -> float:
    """Linear warmup from lr/warmup to lr, then cosine / linear decay to min_lr at `total`, or constant."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    progress = min(1.0, (step - opt.warmup_steps) / max(1, total - opt.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if opt.schedule == "cosine" else 1 - progress
    return opt.min_lr + (opt.lr - opt.min_lr) * decay


def make_optimizer(pm: ParallelModel, opt: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW; norms and biases (1-D) are not decayed. Vocab padding rows get no gradient and so stay zero."""
    decay = [p for p in pm.parameters() if p.ndim >= 2]
    plain = [p for p in pm.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, fused=True)


def injected(kind: str, step: int) -> bool:
    """A test hook (module docstring): whether MEGA_TRAIN_INJECT asks for `kind` at this step."""
    return f"{kind}@{step}" in os.environ.get("MEGA_TRAIN_INJECT", "").split(",")


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's warning before preemption) set a flag read at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def train(plan: RunPlan, peak: float | None = None) -> dict | None:
    """Train (or resume) `plan`'s run. Rank 0 returns what an orchestrator passes on (`finished`:
    the newest checkpoint, how far the run got, its last losses); the other ranks None."""
    run, config = plan.run, plan.config
    G, S = run.batch.global_batch_size, run.batch.seq_length
    configure_allocator(device_type())
    mesh = build_mesh(run.parallel.tp, run.parallel.pp)
    rank = dist.get_rank()
    device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else "cpu"
    torch.manual_seed(run.seed)
    if rank == 0:
        plan.out.mkdir(parents=True, exist_ok=True)
        (plan.out / RUN_MARK).write_text(f"{PRODUCER} {__version__}\n")
        plan.checkpoints.mkdir(parents=True, exist_ok=True)

    # Resume from the newest complete checkpoint of this run (when it is the same run), else start
    # from `init` or from fresh weights.
    found = [newest(plan.checkpoints) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    resumed = found[0]
    if resumed is not None:
        try:
            check_resumable(*resumed, config, plan.fingerprint, str(plan.path))
        except UserError as e:
            shutdown()
            raise e if rank == 0 else Silent(e.exit_code) from None
    # Before the heavy work, so that a W&B that cannot start fails the run early; none for a run
    # that is already complete.
    complete = resumed is not None and resumed[1].training.step >= run.train_steps
    wb = WandbLog.open(plan, resumed is not None) if rank == 0 and not complete else None

    # Data: rank 0 builds (or finds) the index, the others then load it from the cache.
    def datasets() -> tuple[Dataset, Dataset | None]:
        def build(which: str, samples: int) -> Dataset:
            return Dataset.build(
                plan.data, run.data.split, which, S, samples, run.seed, plan.out / "data-index",
                packing=run.data.packing, doc_mask=run.data.doc_mask,
            )  # fmt: skip

        return build("train", run.train_steps * G), build(
            "valid", run.eval.iters * G
        ) if run.eval.every else None

    if rank == 0:
        train_data, valid_data = datasets()
        if train_data.truncated:
            say(
                f"mega-train: warning: {train_data.truncated} conversations of the train split are longer "
                f"than seq_length + 1 = {S + 1} tokens and are cut to it"
            )
    dist.barrier()
    if rank != 0:
        train_data, valid_data = datasets()
    # Loss on the assistant's tokens only: their role code (the plan checked every source has it).
    train_role = plan.data[0][1].roles["assistant"] if run.data.loss_on == "assistant" else None
    # Chat data trained on every token: evaluation also reports the assistant's tokens alone.
    chat = valid_data is not None and valid_data.has_roles and valid_data.has_positions
    assistant_code = plan.data[0][1].roles.get("assistant") if chat and train_role is None else None
    # Some targets may not count: chat data (always packed, as a loss on the assistant needs) or
    # document masking; both come with positions.
    masked = train_data.has_positions

    par = Parallelism(run.parallel, run.precision, plan.grad_accum, run.compile, run.recompute)
    pm = ParallelModel(config, par, mesh, device)
    for part in pm.parts:
        part.set_attention(run.attention)
    opt = make_optimizer(pm, run.optimizer)
    state = State(loss_scale=run.optimizer.initial_loss_scale if run.precision == "fp16" else None)

    if resumed is not None:
        path, manifest = resumed
        load_checkpoint(path, pm, opt)
        t = manifest.training
        applied = t.step if t.optimizer_steps is None else t.optimizer_steps
        state = State(t.step, applied, t.loss_scale, {**state.counters, **t.counters}, dict(t.metrics))
        rng = load_rank_state(path, manifest)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
        if rank == 0:
            done = " — already complete, nothing to do" if state.step >= run.train_steps else ""
            say(f"mega-train: resuming from {path} (step {state.step} of {run.train_steps}){done}")
    elif plan.init is not None:
        load_checkpoint(plan.init[0], pm)  # weights only: fine-tuning starts a new optimizer
    else:
        pm.init_weights(run.model.init_std, run.seed)
    log = MetricsLog(plan.out, state.step if resumed else None) if rank == 0 else None

    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    pp_group = mesh["pp"].get_group() if run.parallel.pp > 1 else None
    params = list(pm.parameters())
    flops = flops_per_token(config, S)
    peak_flops = peak_tflops(peak, run.precision)
    world = dist.get_world_size()
    # On a terminal: the steps of this invocation, their rate and the ETA.
    todo = run.train_steps - state.step
    progress = Progress("mega-train", "steps", total=todo, enabled=None if rank == 0 else False)
    stop = StopRequest()
    saved_at = state.step if resumed else None
    last = resumed[0] if resumed else None  # the newest checkpoint of this run

    parents = [parent_of(p) for p in plan.inputs] if rank == 0 else []  # lineage: init and data

    def save() -> None:
        nonlocal saved_at, last
        path = step_dir(plan.checkpoints, state.step)
        training = TrainingState(
            step=state.step,
            consumed_samples=state.step * G,
            scheduler={
                "name": run.optimizer.schedule,
                "lr": lr_at(max(state.step - 1, 0), run.optimizer, run.train_steps),
            },
            optimizer="adamw",
            optimizer_steps=state.optimizer_steps,
            loss_scale=state.loss_scale,
            counters=dict(state.counters),
            run=plan.fingerprint,
            metrics={k: v for k, v in state.metrics.items() if math.isfinite(v)},
        )
        kill = injected("kill-in-save", state.step)
        save_checkpoint(
            path, pm, opt, training, producer=(PRODUCER, __version__), inputs=plan.inputs,
            rank_state={"cpu": torch.get_rng_state()},
            on_written=(lambda: os.kill(os.getpid(), signal.SIGKILL)) if kill else None,
            tokenizer=plan.tokenizer, parents=parents,
            license=plan.license,
        )  # fmt: skip
        saved_at, last = state.step, path
        if rank == 0:
            point_latest(plan.checkpoints, path)
            prune(plan.checkpoints, run.checkpoint.keep)
            say(f"mega-train: saved {path}")

    def evaluate() -> dict[str, float]:
        """Loss, accuracy and the user's metrics over the first `eval.iters` valid batches (the
        same ones in every layout and resume), on every rank."""
        sums = EvalSums(run.eval.metrics, plan.eval_metrics, str(plan.path))
        for k in range(run.eval.iters):
            b = rows(valid_data, k)
            tokens, targets, positions, counted = batch(b)
            on_logits = sums.add_logits
            if assistant_code is not None and pm.reports_logits:
                # Chat data with the loss on every token: the assistant's tokens reported apart too,
                # microbatch by microbatch, in the order evaluate goes through them.
                assistant = inputs_and_targets(b.tokens, b.positions, b.roles, assistant_code)[2]
                parts = iter(torch.from_numpy(assistant).to(device).chunk(par.microbatches))

                def on_logits(logits: torch.Tensor, tg: torch.Tensor, parts=parts) -> None:
                    sums.add_logits(logits, tg)
                    sums.add_assistant(logits, next(parts))

            loss = pm.evaluate(tokens, targets, on_logits, positions)
            if pm.reports_logits:  # one rank per dp rank, like the metrics
                sums.add_loss(float(loss), counted)
        return sums.combine()

    def rows(data: Dataset, k: int) -> Batch:
        """This rank's rows (its dp share) of global batch k."""
        n = G // dp
        return data.batch(k * G + dp_rank * n, k * G + (dp_rank + 1) * n)

    def batch(b: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
        """Inputs where this rank holds the first stage, targets where it holds the last, positions
        (packed documents) or None, and how many of the targets count."""
        if not masked:
            x = torch.from_numpy(b.tokens).to(device)
            inputs, targets, positions = x[:, :-1], x[:, 1:], None
        else:
            inputs, positions, targets = (
                torch.from_numpy(np.ascontiguousarray(a)).to(device)
                for a in inputs_and_targets(b.tokens, b.positions, b.roles, train_role)
            )
        counted = int((targets != IGNORE).sum()) if masked else targets.numel()
        return (inputs if pm.has_first else None), (targets if pm.has_last else None), positions, counted

    def global_count(counted: int) -> int:
        """The counted targets of the whole global batch: the dp ranks' counts added up."""
        if not masked:
            return G * S
        c = torch.tensor([counted], dtype=torch.int64, device=device)
        dist.all_reduce(c, group=mesh["dp"].get_group())
        return int(c.item())

    def reduce_loss(loss: torch.Tensor | None, counted: int, flag: int = 0) -> tuple[float, int]:
        """The mean loss over the counted targets of the ranks holding the last stage (each rank's
        mean weighted by its count), and the sum of `flag`, on every rank."""
        v = torch.zeros(3, dtype=torch.float64, device=device)
        if loss is not None:
            v[0], v[1] = loss.double() * counted, float(counted)
        v[2] = flag
        dist.all_reduce(v)
        return float(v[0] / v[1]) if v[1] else math.nan, int(v[2])

    clean = False
    try:
        while state.step < run.train_steps:
            t0 = time.perf_counter()
            lr = lr_at(state.step, run.optimizer, run.train_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            tokens, targets, positions, counted = batch(rows(train_data, state.step))
            scale = state.loss_scale or 1.0
            count = global_count(counted)
            local = pm.forward_backward(tokens, targets, scale, positions, count)
            state.step += 1
            if injected("kill", state.step):
                os.kill(os.getpid(), signal.SIGKILL)
            if local is not None and injected("nan-loss", state.step):
                local = torch.full_like(local, float("nan"))
            if rank == 0 and injected("nan-grad", state.step):
                next(p for p in params if p.grad is not None).grad.fill_(float("nan"))
            loss, stopping = reduce_loss(local, counted, stop.signum)
            state.metrics["train_loss"] = loss
            with torch.no_grad():
                if scale != 1.0:
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(1.0 / scale)
                clip = run.optimizer.grad_clip or math.inf
                norm = float(clip_grad_norm(params, clip, pp_group))
            applied = math.isfinite(loss) and math.isfinite(norm)
            if applied:
                opt.step()
                state.optimizer_steps += 1
            opt.zero_grad(set_to_none=True)
            update_counters(state, run, loss, applied)
            dt = time.perf_counter() - t0
            progress.update(1)

            if rank == 0:
                tps = G * S / dt
                record = {
                    "step": state.step, "kind": "train", "loss": loss, "lr": lr, "grad_norm": norm,
                    "tokens_per_s": tps, "counted_tokens": count, "tflops": tps * flops / 1e12,
                    "mfu": tps * flops / 1e12 / peak_flops if peak_flops else None,
                    "skipped": state.counters["skipped"], "nan_steps": state.counters["nan_steps"],
                    "loss_scale": state.loss_scale, "memory_gb": memory_gb(), "step_time_s": dt,
                    "world_size": world,
                }  # fmt: skip
                log.write(record)
                if wb is not None:
                    wb.log(record)
                if state.step % run.logging.every == 0 or state.step == run.train_steps:
                    say(train_line(record, run.train_steps))
            if run.nan.policy == "halt" and state.counters["nan_steps"] >= run.nan.max_steps:
                if rank != 0:
                    raise Silent(Halted.exit_code)
                last = newest(plan.checkpoints)
                raise Halted(
                    f"step {state.step}: loss or gradients not finite ({state.counters['nan_steps']} such "
                    f"steps, $.nan.max_steps {run.nan.max_steps}); stopped without saving, the last "
                    f"checkpoint is {last[0] if last else 'none'}"
                )
            if run.eval.every and (state.step % run.eval.every == 0 or state.step == run.train_steps):
                ev = evaluate()
                if rank == 0:
                    ev_loss = ev.pop("loss")
                    state.metrics["valid_loss"] = ev_loss
                    record = {"step": state.step, "kind": "eval", "loss": ev_loss, "ppl": perplexity(ev_loss)}
                    record.update(ev)  # accuracy, the user's metrics, the assistant's (chat data)
                    if "assistant_loss" in record:
                        record["assistant_ppl"] = perplexity(record["assistant_loss"])
                    log.write(record)
                    if wb is not None:
                        wb.log(record)
                    say(eval_line(record))
            if stopping:
                name = signal.Signals(stop.signum or signal.SIGTERM).name
                if saved_at != state.step:
                    save()
                if rank == 0:
                    say(
                        f"mega-train: {name} at step {state.step}: checkpoint saved; rerun the command to resume"
                    )
                clean = True
                return finished(plan, last, state, name) if rank == 0 else None
            if state.step % run.checkpoint.every == 0 or state.step == run.train_steps:
                save()
        if saved_at != state.step:
            save()
        progress.done()
        clean = True
        return finished(plan, last, state, None) if rank == 0 else None
    except UserError:
        clean = True  # every rank decided it alike (a halt): they can still meet at the barrier
        raise
    finally:
        stop.restore()
        if log is not None:
            log.close()
        if wb is not None:  # an exception on its way out (a halt too) marks the W&B run failed
            wb.finish(ok=sys.exc_info()[0] is None)
        if clean:
            shutdown()


def finished(plan: RunPlan, last: Path | None, state: State, stopped_by: str | None) -> dict:
    """The run's summary for `--json`: `out` is its newest checkpoint (the artifact to pass on)."""
    t = plan.run.parallel
    return {
        "out": str(last) if last is not None else None,
        "kind": "checkpoint",
        "manifest_sha256": parent_of(last).manifest_sha256 if last is not None else None,
        "run": str(plan.out),
        "step": state.step,
        "train_steps": plan.run.train_steps,
        "complete": state.step >= plan.run.train_steps,
        "stopped_by": stopped_by,
        "optimizer_steps": state.optimizer_steps,
        "skipped_steps": state.counters["skipped"],
        "train_loss": _finite(state.metrics.get("train_loss")),
        "valid_loss": _finite(state.metrics.get("valid_loss")),
        "layout": {"tp": t.tp, "pp": t.pp, "dp": dist.get_world_size() // (t.tp * t.pp)},
        "metrics": str(plan.out / "metrics.jsonl"),
    }


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def update_counters(state: State, run, loss: float, applied: bool) -> None:
    """fp16: an overflow in the gradients (finite loss) halves the loss scale and skips the step;
    `loss_scale_window` clean steps double it. Any other non-finite step is a NaN step (nan.policy)."""
    c = state.counters
    if not applied:
        c["skipped"] += 1
    if state.loss_scale is not None:
        if not applied and math.isfinite(loss):
            state.loss_scale = max(state.loss_scale / 2, 1.0)
            c["scale_good"] = 0
            return
        c["scale_good"] = c["scale_good"] + 1 if applied else 0
        if c["scale_good"] >= run.optimizer.loss_scale_window:
            state.loss_scale *= 2
            c["scale_good"] = 0
    if not applied:
        c["nan_steps"] += 1
