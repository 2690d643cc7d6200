"""The preference objectives (`objective` dpo, simpo or orpo): the trainer's steps over pairs.

`PreferenceObjective`'s hooks (`base.Objective`) differ from language modelling's thus:
- the batch counts pairs, two rows each (`megacore.data.pairs`: chosen then rejected, whole in
  their rows), so a microbatch never splits a pair; a step's rows are `2 x global_batch_size`, cut
  after the longest sequence of the rank's batch (`_trimmed`). With `"packing": "pack"` a row holds
  whole pairs, as many as fit: the batch counts rows, and the step's pairs are counted on the
  device (one all-reduce, as a language model's counted tokens);
- the targets are the completions' tokens (their role code, `completion`); the engine's loss is
  `megacore.parallel.row_sums.RowSums`: it sums each side's log-probabilities of them and hands
  them to the objective's formulas (`megacore.models.preference`), whose mean over the batch's pairs
  is the loss;
- DPO's reference is the model `objective.reference` names (`reference_plan.py`: the base, the
  model the run starts from, or a checkpoint): its log-probabilities of every row the run will
  train and evaluate on are computed once, before the first step, with the engine's forward in the
  run's layout, and stored in the run directory (`reference-logps.safetensors`, with a key of
  everything they depend on), so a resumed run reads them back. Precomputed by default: the
  reference then costs one forward per row once instead of a second model in memory (without
  LoRA) or a second forward every step. Under LoRA `"reference_logps": "live"` computes them
  beside each step instead, for data too large to go over twice: the base is in memory anyway, and
  the reference is a forward with the adapters off or with the reference adapters' values swapped
  in (kept beside the trained ones: no second copy of the base);
- TRL's metrics (`rewards/chosen`, ..., `megacore.models.preference.METRICS`) in every train and
  eval record: sums over the pairs of every rank, one all-reduce, divided by the batch's pairs.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import ExitStack

import torch
import torch.distributed as dist

from mega_train import __version__
from mega_train.checkpoints import PRODUCER
from mega_train.metrics import say
from mega_train.objectives.base import Objective
from megacore.artifacts.reader import parent_of
from megacore.config import is_adapter_tensor
from megacore.data.dataset import Batch, Dataset
from megacore.data.packing import PAD
from megacore.errors import UserError
from megacore.models.lora import adapters_off, adapters_swapped
from megacore.models.preference import METRICS, Preference, pair_losses, pair_metrics
from megacore.parallel.row_sums import RowsFn, RowSums

REFERENCE_FILE = "reference-logps.safetensors"


class PreferenceObjective(Objective):
    """A preference objective's run half (module docstring)."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        t = self.t
        spec = t.run.objective
        self.objective = Preference(spec.type, spec.beta, spec.loss, spec.label_smoothing, spec.gamma)
        self.packed = t.plan.packs_pairs
        self._count: torch.Tensor | int = t.samples  # the pairs of the batch in hand
        self.reference: dict[str, torch.Tensor] = {}  # "train", "valid": [batches, rows]
        self.reference_adapters: list[torch.Tensor] = []  # a live reference's adapter values
        par = t.run.parallel
        fixed = par.pp > 1 or t.plan.compiles(torch.cuda.is_available())
        self.seq_multiple = None if fixed else math.lcm(8, t.plan.dims.seq_multiple(par.sequence_parallel))
        self._sums: dict[int, torch.Tensor] = {}  # each microbatch's metric sums, of a step or evaluation

    def roles(self, valid: Dataset | None) -> tuple[int, None]:
        """The completions' tokens are the targets; nothing is reported apart."""
        return self.t.plan.data[0][1].roles["completion"], None

    def open_data(self) -> None:
        t = self.t
        self.slots = max(d.pair_slots for d in (t.train_data, t.valid_data) if d is not None)
        if t.rank == 0 and t.train_data.skipped_pairs:
            what = "are, both sides together," if self.packed else "have a side"
            say(
                f"mega-train: warning: {t.train_data.skipped_pairs} pairs of the train split {what} "
                f"longer than seq_length + 1 = {t.S + 1} tokens and are left out"
            )

    def _rows_loss(self, fn: RowsFn) -> RowSums:
        pm = self.t.pm
        return RowSums(fn, pm.config.vocab_size, pm.tp_mesh, pm.cp_mesh, self.slots)

    # --- the reference --------------------------------------------------------------------------

    def start(self) -> None:
        t, ref = self.t, self.t.plan.reference
        if ref is not None and not ref.live:
            self.reference = self._stored_reference() or self._compute_reference()
        elif ref is not None and ref.kind == "adapters":  # live: their values kept, to be swapped in
            t.load_weights(ref.path, only=is_adapter_tensor)
            self.reference_adapters = [p.detach().clone() for p in t.params]

    def _reference_key(self) -> str:
        """What the reference's log-probabilities depend on: the init checkpoint, the data and how
        the rows are drawn from it, the precision, how many batches."""
        t = self.t
        run, plan = t.run, t.plan
        blob = {
            "init": parent_of(plan.init[0]).manifest_sha256,
            "sources": [parent_of(p).manifest_sha256 for p, _, _ in plan.data],
            "weights": [w for _, _, w in plan.data],
            "split": run.data.split, "seq_length": t.S, "rows": t.G, "seed": run.seed,
            "train": run.train_steps, "valid": run.eval.iters if run.eval.every else 0,
            "precision": run.precision, "lora": plan.lora is not None, "packed": self.packed,
            **plan.reference.key(),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()

    def _stored_reference(self) -> dict[str, torch.Tensor] | None:
        """The stored log-probabilities when they are this run's (same key), else None."""
        from safetensors import safe_open

        path = self.t.plan.out / REFERENCE_FILE
        if not path.is_file():
            return None
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if meta.get("producer") != PRODUCER:
                raise UserError(f"{path} was not written by mega-train; move it out of the run directory")
            if meta.get("key") != self._reference_key():
                return None
            return {k: f.get_tensor(k).to(self.t.device) for k in f.keys()}  # noqa: SIM118 (safe_open)

    def _compute_reference(self) -> dict[str, torch.Tensor]:
        """The reference's log-probabilities of every train and valid row (collective), written
        by rank 0 (replacing an earlier run's, whose key differs)."""
        t = self.t
        ref = t.plan.reference
        base = (lambda name: not is_adapter_tensor(name)) if t.plan.lora is not None else None
        # A whole model in the base's place (read once, not over init's), or adapters on init's base.
        t.load_weights(ref.path if ref.kind == "model" else t.plan.init[0], only=base)
        if ref.kind == "adapters":
            t.load_weights(ref.path, only=is_adapter_tensor)
        with self._as_reference():
            out = {"train": self._logps(t.train_data, t.run.train_steps)}
            if t.valid_data is not None:
                out["valid"] = self._logps(t.valid_data, t.run.eval.iters)
        if t.rank == 0:
            from safetensors.torch import save_file

            path = t.plan.out / REFERENCE_FILE
            tmp = path.with_name(f".{path.name}.tmp")
            meta = {"producer": PRODUCER, "version": __version__, "key": self._reference_key()}
            save_file({k: v.cpu().contiguous() for k, v in out.items()}, tmp, metadata=meta)
            tmp.replace(path)
            say(
                f"mega-train: reference log-probabilities of {sum(v.numel() for v in out.values())} rows in {path}"
            )
        return out

    def _as_reference(self) -> ExitStack:
        """The model in memory as the reference: under LoRA with the adapters off (the base, or a
        whole model loaded in its place), or with the reference adapters swapped in (live); else
        as it is (precomputed: what `_compute_reference` loaded)."""
        t, stack = self.t, ExitStack()
        ref = t.plan.reference
        if ref.kind == "adapters" and ref.live:
            stack.enter_context(adapters_swapped(t.params, self.reference_adapters))
        elif ref.kind != "adapters":
            for part in t.pm.parts if t.plan.lora is not None else ():
                stack.enter_context(adapters_off(part))
        return stack

    def _logps(self, data: Dataset, batches: int) -> torch.Tensor:
        """The model's summed log-probability of every side's completion, [batches, rows x slots],
        on every rank: each dp rank's rows from the ranks that report them, added up over the
        world."""
        t = self.t
        table = torch.zeros(batches, t.G * self.slots, dtype=torch.float64, device=t.device)
        n = t.G // t.dp * self.slots
        for k in range(batches):
            mine = self._batch_logps(data, k)
            if t.pm.reports_logits:
                table[k, t.dp_rank * n : (t.dp_rank + 1) * n] = mine
        dist.all_reduce(table)
        return table

    def _batch_logps(self, data: Dataset, k: int) -> torch.Tensor | None:
        """The model's summed log-probability of each side of this rank's rows of batch k
        (collective; None where no stage computes them)."""
        got: dict[int, torch.Tensor] = {}

        def keep(logps: torch.Tensor, counted: torch.Tensor, i: int) -> torch.Tensor:
            got[i] = logps.detach().double()
            return logps.sum()

        tokens, targets, positions, _ = self.batch(self.t.rows(data, k), self.t.train_role)
        self.t.pm.evaluate(tokens, targets, positions=positions, loss=self._rows_loss(keep))
        return torch.cat([got[i] for i in sorted(got)]) if got else None

    # --- steps and evaluation -------------------------------------------------------------------

    def batch(self, b: Batch, role: int | None) -> tuple:
        """The trainer's, counting this rank's pairs (packed: the sides' first tokens, halved; a
        device tensor), cut after its longest sequence."""
        inputs, targets, positions, _ = self.t.batch(self._trimmed(b), role)
        if not self.packed:
            return inputs, targets, positions, b.tokens.shape[0] // 2
        sides = int(((b.positions == 0) & (b.tokens != PAD)).sum())
        return inputs, targets, positions, torch.tensor(sides // 2, device=self.t.device)

    def _trimmed(self, b: Batch) -> Batch:
        """The batch without the columns after its longest sequence, which are padding in every
        row (a row holds one sequence from its start), kept to a multiple of `seq_multiple`: the
        same losses, and no compute spent on padding (TRL pads each batch to its longest too).
        Not under a pipeline, whose stages' shapes are fixed at the first step, nor compiled."""
        if self.seq_multiple is None:
            return b
        longest = int((b.tokens != PAD).sum(1).max())
        keep = min(self.t.S, -(-(longest - 1) // self.seq_multiple) * self.seq_multiple) + 1
        cut = [None if a is None else a[:, :keep] for a in b]
        return Batch(*cut)

    def global_count(self, counted: torch.Tensor | int) -> torch.Tensor | int:
        """The batch's pairs: known unless packed (then the dp ranks' added up)."""
        self._count = self.t.global_count(counted) if self.packed else self.t.samples
        return self._count

    def loss(self, which: str, k: int) -> RowSums:
        """The objective over batch k of `which`, its reference rows by microbatch."""
        t = self.t
        refs: list[torch.Tensor] | None = None
        if self.reference:
            n = t.G // t.dp * self.slots
            mine = self.reference[which][k, t.dp_rank * n : (t.dp_rank + 1) * n]
            refs = list(mine.to(torch.float32).chunk(t.pm.par.microbatches))
        elif self.objective.needs_reference:  # live: the reference now, from the model in memory
            with self._as_reference():
                mine = self._batch_logps(t.train_data if which == "train" else t.valid_data, k)
            refs = None if mine is None else list(mine.to(torch.float32).chunk(t.pm.par.microbatches))
        self._sums = {}

        def rows_loss(logps: torch.Tensor, counted: torch.Tensor, i: int) -> torch.Tensor:
            ref = refs[i].to(logps.dtype) if refs is not None else None
            loss, stats = pair_losses(self.objective, logps.float(), counted, ref)
            self._sums[i] = pair_metrics(stats.double())  # a repeated microbatch replaces its sums
            return loss.sum()

        return self._rows_loss(rows_loss)

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's metrics of the last batch, over every rank's pairs (one all-reduce)."""
        t = self.t
        total = torch.zeros(len(METRICS), dtype=torch.float64, device=t.device)
        if t.pm.reports_logits and self._sums:
            total += torch.stack(list(self._sums.values())).sum(0)
        dist.all_reduce(total)
        return dict(zip(METRICS, total / self._count, strict=True))

    def evaluate(self) -> dict[str, float]:
        """The objective's loss and TRL's metrics over the first `eval.iters` valid batches."""
        t = self.t
        losses, sums = [], {}
        for k in range(t.run.eval.iters):
            loss_fn = self.loss("valid", k)
            tokens, targets, positions, counted = self.batch(t.rows(t.valid_data, k), t.train_role)
            self.global_count(counted)
            loss = t.pm.evaluate(tokens, targets, positions=positions, loss=loss_fn)
            losses.append(t.reduce_loss(loss if t.pm.has_last else None, counted)[0])
            for name, v in self.metrics().items():
                sums[name] = sums.get(name, 0.0) + v
        values = torch.stack([*losses, *sums.values()]).tolist()
        iters = t.run.eval.iters
        return {
            "loss": sum(values[:iters]) / iters,
            **{k: v / iters for k, v in zip(sums, values[iters:], strict=True)},
        }

    def eval_record(self, ev: dict[str, float]) -> dict:
        self.t.position.metrics["valid_loss"] = ev["loss"]
        return {"step": self.t.position.step, "kind": "eval", **ev}
