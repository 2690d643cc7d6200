"""mega-train's trainer: a run's phases as methods of one object, read top to bottom.

`Trainer(plan)` on every rank with the same checked `RunPlan`, then:

- `setup`: the mesh, the run directory and its lock (`lifecycle.py`), the stop flag and the
  launcher watch, the sample index (`train_data.py`), the `ParallelModel` and AdamW (`optimizer.py`).
- `resume`: the newest intact checkpoint of this run (damaged ones set aside: `resuming.py`,
  `checkpoints.py`), else `init`'s weights, else fresh ones; a changed `train_steps` stretches the
  schedule (`schedule.py`).
- `step`: global batch `step` of the train samples (`megacore.data.Dataset`: the sequence depends
  on the seed and the data only), this rank's dp share as microbatches through
  `ParallelModel.forward_backward` (the loss is the mean over the global batch's counted targets);
  one all-reduce brings every rank the loss and the stop request; then unscale (fp16), the global
  gradient norm and clipping (`optimizer.py`), and the update, which the optimizer skips on the
  device when loss or norm is not finite. The step reads one small tensor back to the host, once it
  is queued: whether to stop and whether loss and norm were finite (`LossScale`, the NaN policy);
  every other value (loss, norm, counts, router statistics) stays on the device until `flush`.
- `flush` at every logging step (and before an evaluation, a save, a stop or a halt): the pending
  steps' values read back at once (`step_records.py`), each step's record written to metrics.jsonl
  and W&B on rank 0, and the console line when due, with every rank's own work per step and the
  stragglers named (`stragglers.py`); `evaluate` every `eval.every` steps and after the last one
  (`evaluation.py`), with lm-eval's `eval.tasks` (`sampling.task_records`, `harness.py`); samples
  every `eval.samples.every` steps (`sampling.py`); `save` writes an atomic checkpoint (`saving.py`).
- `fit` loops over them and stops at `train_steps`, at a stop request (one checkpoint, then exit 0)
  or at `nan.policy: halt` (exit 1).

What differs between objectives (language modelling, preference pairs, distillation) is the
objective's (`mega_train.objectives`, chosen by `objective.type`): the trainer calls its hooks and
names none. `train(plan, faults=...)` runs the whole; the CLI parses the fault injection tests ask
for (`faults.py`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from mega_train import __version__
from mega_train.allocator import configure_allocator
from mega_train.checkpoints import PRODUCER, resume_point
from mega_train.faults import Faults
from mega_train.lifecycle import RunLock, StopRequest, describe, watch_launcher, watch_signals
from mega_train.metrics import (
    MetricsLog,
    compile_seconds,
    eval_line,
    peak_tflops,
    say,
    train_line,
)
from mega_train.objectives import load as load_objective
from mega_train.optimizer import make_optimizer, unscale_and_clip
from mega_train.resuming import Position, load_resumed, newest_intact, set_aside_damaged
from mega_train.run_plan import RUN_MARK, RunPlan
from mega_train.sampling import open_generation, sample_line, task_records
from mega_train.saving import Saver
from mega_train.schedule import LossScale, Schedule
from mega_train.step_records import Pending, read_back, train_record
from mega_train.stragglers import OwnWork, straggler_line, stragglers
from mega_train.train_data import open_samples
from mega_train.wandb_run import WandbLog
from mega_train.watchdog import Watchdog
from megacore.artifacts.manifest import CheckpointManifest
from megacore.artifacts.reader import parent_of
from megacore.config import CONTEXT_FIELDS, TOKEN_ID_FIELDS, is_adapter_tensor
from megacore.data.dataset import Batch, Dataset
from megacore.data.packing import IGNORE, inputs_and_targets
from megacore.errors import Silent, UserError
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.mesh import build_mesh, device_type, dp_mesh, shutdown
from megacore.planner.counts import flops_per_token
from megacore.progress import Progress

T = TypeVar("T")


class Halted(UserError):
    """The run stopped itself (nan.policy halt): exit 1, the last checkpoint left as it was."""

    exit_code = 1


class Trainer:
    """One rank's part of a run (module docstring)."""

    def __init__(self, plan: RunPlan, peak: float | None = None, faults: Faults | None = None) -> None:
        self.plan, self.run = plan, plan.run
        # What the batch counts (sequences, pairs: the objective's), and the data rows it is.
        self.samples, self.S = plan.run.batch.global_batch_size, plan.run.batch.seq_length
        self.G = plan.rows_per_sample * self.samples
        self.peak = peak
        self.faults = faults
        self.lock: RunLock | None = None
        self.stop: StopRequest | None = None
        self.log: MetricsLog | None = None
        self.wb: WandbLog | None = None
        self.position = Position()
        self.resumed: Path | None = None  # the checkpoint this run resumed from
        self.last: Path | None = None  # the run's newest checkpoint
        self.saved_at: int | None = None
        self.pending: list[Pending] = []  # steps whose device values are not read back yet
        self.watchdog: Watchdog | None = None
        self.first_step = 1  # of this start (`fit`): the stragglers' report leaves its interval out
        self.objective = load_objective(self)

    # --- set up -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Mesh, lock, stop flag, data and model; collective."""
        run = self.run
        trim = configure_allocator(device_type(), frozen_base=self.plan.lora is not None)
        watch_signals()  # before the first connect: a stop must end a worker stuck in one
        dims = self.plan.dims
        self.mesh = build_mesh(dims.tp, dims.pp, dims.cp, dims.ep)
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else "cpu"
        torch.manual_seed(run.seed)
        self.on_rank0(self._claim_run_dir)
        self.stop = StopRequest()
        watch_launcher()
        self._open_data()
        self.objective.open_data()
        par = dataclasses.replace(
            self.plan.parallelism, compile=self.plan.compiles(torch.cuda.is_available())
        )
        self.pm = ParallelModel(self.plan.config, par, self.mesh, self.device)
        self.pm.before_microbatch = trim
        self.saver = Saver(self)
        hang_s = run.watchdog.hang_s
        self.watchdog = Watchdog(hang_s, self.plan.out, self.rank, dist.get_world_size()) if hang_s else None
        self.params = [p for p in self.pm.parameters() if p.requires_grad]  # LoRA: the adapters
        self.opt = make_optimizer(self.params, run.optimizer)
        fp16 = run.precision == "fp16"
        self.scaler = LossScale(
            run.optimizer.initial_loss_scale if fp16 else None, run.optimizer.loss_scale_window
        )
        self.schedule = Schedule(run.optimizer, run.train_steps)
        data = dp_mesh(self.mesh)
        self.dp, self.dp_rank, self.dp_group = data.size(), data.get_local_rank(), data.get_group()
        self.pp_group = self.mesh["pp"].get_group() if run.parallel.pp > 1 else None
        self.own = OwnWork(self.device, self.mesh["pp"].get_local_rank() if self.pp_group else 0)
        # Once, not per step: the device's peak is a name lookup in a table.
        self.flops = flops_per_token(self.plan.config, self.S)
        self.peak_flops = peak_tflops(self.peak, run.precision)
        self.sampler, self.lm = open_generation(self.plan, self.pm)  # eval.samples, eval.tasks
        self.objective.setup()

    def on_rank0(self, work: Callable[[], T]) -> T:
        """Run `work` on rank 0 and hand every rank its result; a UserError it raises stops every
        rank alike (rank 0 says it, the others exit quietly with its code)."""
        box: list = [None, None]
        error: UserError | None = None
        if self.rank == 0:
            try:
                box[0] = work()
            except UserError as e:
                error, box[1] = e, e.exit_code
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            shutdown()
            raise error if error is not None else Silent(box[1])
        return box[0]

    def _claim_run_dir(self) -> None:
        """Rank 0: the lock first, before anything is written into `out`."""
        plan = self.plan
        plan.out.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(plan.out)
        self.lock.acquire(f"{plan.path}: $.out")
        if self.lock.took_over:
            say(
                f"mega-train: taking over {self.lock.path}, left by {describe(self.lock.took_over)}, which is gone"
            )
        (plan.out / RUN_MARK).write_text(f"{PRODUCER} {__version__}\n")
        plan.checkpoints.mkdir(parents=True, exist_ok=True)

    def _open_data(self) -> None:
        """The sample indexes (`train_data.py`) and which of their targets count."""
        self.train_data, self.valid_data = open_samples(self.plan, self.rank, self.G)
        self.train_role, self.assistant_code = self.objective.roles(self.valid_data)
        # Some targets may not count: chat data or document masking; both come with positions.
        self.masked = self.train_data.has_positions

    # --- resume -------------------------------------------------------------------------------

    def resume(self) -> None:
        """The newest intact checkpoint of this run, else `init`'s weights, else fresh ones. LoRA:
        the frozen base from `init` first, then the adapters likewise (`lora.init`'s, else PEFT's
        fresh ones). The objective's `start` first."""
        self.objective.start()
        if self.plan.lora is not None:
            self.load_weights(self.plan.init[0], only=lambda name: not is_adapter_tensor(name))
        trained = is_adapter_tensor if self.plan.lora is not None else None
        while (found := self.on_rank0(lambda: newest_intact(self.plan.checkpoints))) is not None:
            path, manifest = found
            try:
                self.plan.check_resume(path, manifest)
            except UserError as e:
                shutdown()
                raise e if self.rank == 0 else Silent(e.exit_code) from None
            damage, rng = load_resumed(path, manifest, self.pm, self.opt, trained, self.device)
            if damage is None:
                self._restore(path, manifest, rng)
                return
            self.on_rank0(lambda path=path, damage=damage: set_aside_damaged(path, damage))
        self.opt.state.clear()  # whatever a damaged checkpoint left there
        lora = self.plan.lora
        if lora is not None and lora.init is not None:
            self.load_weights(lora.init[0], only=is_adapter_tensor)
        elif lora is not None:
            self.pm.init_weights(seed=self.run.seed, only=is_adapter_tensor)
        elif self.plan.init is not None:
            self.load_weights(self.plan.init[0])
        else:
            self.pm.init_weights(self.run.model.init_std, self.run.seed)
        self._open_reports(resumed=False)

    def load_weights(self, path: Path, only: Callable[[str], bool] | None = None) -> None:
        """A start's weights (`init`'s, an adapter's; `only`: some of them), no moments: fine-tuning
        starts a new optimizer, and the run may set another context."""
        load_checkpoint(path, self.pm, ignore=(*TOKEN_ID_FIELDS, *CONTEXT_FIELDS), only=only)

    def _restore(self, path: Path, manifest: CheckpointManifest, rng: dict[str, torch.Tensor] | None) -> None:
        """The run's state as the checkpoint `path` left it (its weights and moments are loaded):
        the position, the loss scale, this rank's RNG state and the schedule, stretched when
        `train_steps` changed."""
        t, run = manifest.training, self.run
        applied = t.step if t.optimizer_steps is None else t.optimizer_steps
        self.position = Position(t.step, applied, dict(t.metrics))
        self.scaler.scale = t.loss_scale
        self.scaler.counters.update(t.counters)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
        saved = Schedule.restored(run.optimizer, t.scheduler, run.train_steps)
        self.schedule = saved.resized(run.train_steps, t.step)
        self.resumed = self.last = path
        self.saved_at = t.step
        if self.rank == 0:
            done = " — already complete, nothing to do" if t.step >= run.train_steps else ""
            say(f"mega-train: resuming from {path} (step {t.step} of {run.train_steps}){done}")
            if saved.total != run.train_steps and t.step < run.train_steps:
                say(
                    f"mega-train: train_steps {saved.total} -> {run.train_steps} on resume: the learning rate "
                    f"continues from {self.schedule.lr(t.step):.3g}, what is left of its decay spread over "
                    f"steps {t.step + 1}..{run.train_steps}"
                )
        self._open_reports(resumed=True)

    def _open_reports(self, resumed: bool) -> None:
        """metrics.jsonl (cut back to the resumed step) and W&B (none for a run already complete)."""
        if self.rank != 0:
            return
        self.log = MetricsLog(self.plan.out, self.position.step if resumed else None)
        if self.position.step < self.run.train_steps:
            self.wb = WandbLog.open(self.plan, resumed)

    # --- a step -------------------------------------------------------------------------------

    def rows(self, data: Dataset, k: int) -> Batch:
        """This rank's rows (its dp share) of global batch k."""
        n = self.G // self.dp
        return data.batch(k * self.G + self.dp_rank * n, k * self.G + (self.dp_rank + 1) * n)

    def batch(
        self, b: Batch, role: int | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | int]:
        """Inputs where this rank holds the first stage, targets where it holds the last, positions
        (packed documents) or None, and how many of the targets count (a device tensor when some
        may not: nothing is read back)."""
        if not self.masked:
            x = self.to_device(b.tokens)
            inputs, targets, positions = x[:, :-1], x[:, 1:], None
        else:
            inputs, positions, targets = (
                self.to_device(a) for a in inputs_and_targets(b.tokens, b.positions, b.roles, role)
            )
        counted = (targets != IGNORE).sum() if self.masked else targets.numel()
        pm = self.pm
        return (inputs if pm.has_first else None), (targets if pm.has_last else None), positions, counted

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """A batch array on the device; on a GPU through pinned memory, so the copy does not wait
        for the device's queue (a plain copy from pageable memory would)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def global_count(self, counted: torch.Tensor | int) -> torch.Tensor | int:
        """The counted targets of the whole global batch: the dp ranks' counts added up (on the
        device when some targets may not count)."""
        if not self.masked:
            return self.G * self.S
        c = counted.clone()
        dist.all_reduce(c, group=self.dp_group)
        return c

    def reduce_loss(
        self, loss: torch.Tensor | None, counted: torch.Tensor | int, flag: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean loss over the counted targets of the ranks holding the last stage (each rank's
        mean weighted by its count; NaN where none counts), and the sum of `flag`, on every rank:
        device tensors, one all-reduce."""
        f64 = {"dtype": torch.float64, "device": self.device}
        c = counted.double() if isinstance(counted, torch.Tensor) else torch.full((), float(counted), **f64)
        zero = torch.zeros((), **f64)
        parts = [loss.double() * c, c] if loss is not None else [zero, zero]
        v = torch.stack([*parts, torch.full((), float(flag), **f64)])
        dist.all_reduce(v)
        return v[0] / v[1], v[2]

    def step(self) -> bool:
        """Train one step (its record pending until `flush`); returns whether any rank was asked to
        stop."""
        t0, compiled = time.perf_counter(), compile_seconds()
        pos = self.position
        lr = self.schedule.lr(pos.step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        objective = self.objective
        loss_fn = objective.loss("train", pos.step)
        with self.own.host():
            tokens, targets, positions, counted = objective.step_rows(pos.step)
        scale = self.scaler.factor
        count = objective.global_count(counted)
        out = self.pm.forward_backward(tokens, targets, scale, positions, count, loss_fn)
        pos.step += 1
        local = out.loss
        if self.faults is not None:
            local = self.faults.after_backward(pos.step, local, self.params)
        loss, stop = self.reduce_loss(local, counted, self.stop.signum if self.stop else 0)
        clip = self.run.optimizer.grad_clip
        norm = unscale_and_clip(self.params, scale, clip, self.pp_group, self.pm.tied_copy)
        finite = torch.stack([torch.isfinite(loss), torch.isfinite(norm)])
        self.opt.found_inf = (~finite.all()).float()  # the fused AdamW skips the update on the device
        with self.own.update():
            if self.faults is not None:
                self.faults.slow(pos.step)
            self.opt.step()
        self.own.end_step()
        self.opt.zero_grad(set_to_none=True)
        # The step's one read back, once its work is queued: the stop request and the finiteness.
        stopping, loss_ok, norm_ok = (bool(v) for v in torch.cat([stop[None] > 0, finite]).tolist())
        if self.scaler.judge(loss_ok, norm_ok):
            pos.optimizer_steps += 1
        dt, compiled = time.perf_counter() - t0, compile_seconds() - compiled
        device = {"loss": loss, "grad_norm": norm, **(out.moe or {}), **objective.metrics()}
        if isinstance(count, torch.Tensor):
            device["counted_tokens"] = count
        record = train_record(
            pos.step, lr, count, dt, compiled, tokens=self.G * self.S, flops=self.flops,
            peak=self.peak_flops, scaler=self.scaler, world_size=dist.get_world_size(),
        )  # fmt: skip
        self.pending.append(Pending(record, device))
        return stopping

    def flush(self) -> list[dict]:
        """The pending steps' device values, read back at once on rank 0 with every rank's own
        work per step (`stragglers.py`), into their records, which are reported (and returned);
        the last train loss kept for checkpoints and the summary."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        ranks = self.own.gather()
        if self.rank != 0:
            return []
        table = read_back(pending, ranks)  # the flush's one read
        for p in pending:
            self.report(p.record)
        self.position.metrics["train_loss"] = pending[-1].record["loss"]
        # Not over a start's first step: its update allocates AdamW's moments (and it may compile).
        for slow in stragglers(table) if pending[0].record["step"] > self.first_step else ():
            say(straggler_line(self.position.step, *slow))
        return [p.record for p in pending]

    def check_halt(self) -> None:
        """`nan.policy: halt` after `nan.max_steps` non-finite steps: every rank stops (exit 1)."""
        nan = self.run.nan
        count = self.scaler.counters["nan_steps"]
        if nan.policy != "halt" or count < nan.max_steps:
            return
        self.saver.wait()
        self.flush()
        if self.rank != 0:
            raise Silent(Halted.exit_code)
        last = resume_point(self.plan.checkpoints)[0]
        raise Halted(
            f"step {self.position.step}: loss or gradients not finite ({count} such steps, $.nan.max_steps "
            f"{nan.max_steps}); stopped without saving, the last checkpoint is {last[0] if last else 'none'}"
        )

    # --- evaluate and report ------------------------------------------------------------------

    def report(self, record: dict) -> None:
        """Rank 0: metrics.jsonl, W&B and, when due, the console."""
        if self.rank != 0:
            return
        self.log.write(record)
        if self.wb is not None:
            self.wb.log(record)
        if record["kind"] == "checkpoint":
            return  # the saver says its own line
        if record["kind"] == "eval":
            say(eval_line(record))
        elif record["kind"] == "eval_task":
            say(f"step {record['step']} eval {record['task']} | {record['metric']} {record['value']:.4g}")
        elif record["kind"] == "sample":
            say(sample_line(record))
        elif record["kind"] == "rollout":
            return  # online RL's completions: metrics.jsonl and W&B only
        elif record["step"] % self.run.logging.every == 0 or record["step"] == self.run.train_steps:
            say(train_line(record, self.run.train_steps))

    # --- save and stop ------------------------------------------------------------------------

    def save(self) -> None:
        """A checkpoint of this step (collective; `saving.Saver`), in the background if asynchronous."""
        self.saver.save()

    def save_now(self) -> None:
        """This step's checkpoint, written before going on (the end, a stop): tried again until it
        is, or saving has failed `saving.MAX_FAILED_SAVES` times in a row (the run then ends)."""
        while self.saved_at != self.position.step:
            self.save()
            self.saver.wait()

    def fit(self) -> dict | None:
        """Steps until `train_steps` or a stop request; rank 0 returns the run's summary."""
        run, pos = self.run, self.position
        self.first_step = pos.step + 1
        progress = Progress(
            "mega-train",
            "steps",
            total=max(0, run.train_steps - pos.step),
            enabled=None if self.rank == 0 else False,
        )
        while pos.step < run.train_steps:
            stopping = self.step()
            progress.update(1)
            self.saver.poll()
            self.check_halt()
            evaluates = run.eval.every and (pos.step % run.eval.every == 0 or pos.step == run.train_steps)
            saves = pos.step % run.checkpoint.every == 0 or pos.step == run.train_steps
            if stopping or evaluates or saves or pos.step % run.logging.every == 0:
                self.flush()
            if evaluates and self.valid_data is not None:
                self.report(self.objective.eval_record(self.objective.evaluate()))
            if evaluates and self.lm is not None:
                for record in task_records(self.lm, self.run.eval, self.plan.task_paths, pos.step):
                    self.report(record)
            if self.sampler is not None and self.sampler.due(pos.step, run.train_steps):
                for record in self.sampler.records(pos.step):
                    self.report(record)
            if stopping:
                name = self.stop.name or "SIGTERM"
                self.save_now()
                if self.rank == 0:
                    say(
                        f"mega-train: {name} at step {pos.step}: checkpoint saved; rerun the command to resume"
                    )
                return self.summary(name)
            if saves:
                self.save()
            if self.watchdog is not None:
                self.watchdog.beat(pos.step)
        self.save_now()
        progress.done()
        return self.summary(None)

    def summary(self, stopped_by: str | None) -> dict | None:
        """The run's summary for `--json` on rank 0: `out` is its newest checkpoint (the artifact to
        pass on); None on the other ranks."""
        if self.rank != 0:
            return None
        pos, last = self.position, self.last
        return {
            "out": str(last) if last is not None else None,
            "kind": "checkpoint",
            "manifest_sha256": parent_of(last).manifest_sha256 if last is not None else None,
            "run": str(self.plan.out),
            "step": pos.step,
            "train_steps": self.run.train_steps,
            "complete": pos.step >= self.run.train_steps,
            "stopped_by": stopped_by,
            "optimizer_steps": pos.optimizer_steps,
            "skipped_steps": self.scaler.counters["skipped"],
            "train_loss": _finite(pos.metrics.get("train_loss")),
            "valid_loss": _finite(pos.metrics.get("valid_loss")),
            "layout": dataclasses.asdict(self.plan.dims),
            "metrics": str(self.plan.out / "metrics.jsonl"),
        }

    def close(self, ok: bool) -> None:
        """Restore the signal handlers, close the reports, release the lock."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.stop is not None:
            self.stop.restore()
        if self.log is not None:
            self.log.close()
        if self.wb is not None:  # an exception on its way out (a halt too) marks the W&B run failed
            self.wb.finish(ok=ok)
        if self.lock is not None:
            self.lock.release()


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def train(plan: RunPlan, peak: float | None = None, faults: Faults | None = None) -> dict | None:
    """Train (or resume) `plan`'s run on this rank, with the faults tests inject (`faults.py`).
    Rank 0 returns the run's summary (`--json`), the other ranks None."""
    trainer = Trainer(plan, peak, faults)
    clean = False
    try:
        trainer.setup()
        trainer.resume()
        summary = trainer.fit()
        clean = True
        return summary
    except UserError:
        clean = True  # every rank decided it alike (a halt): they can still meet at the barrier
        raise
    finally:
        trainer.close(ok=sys.exc_info()[0] is None)
        if clean:
            shutdown()
