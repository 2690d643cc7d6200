"""A preference run (`objective` dpo, simpo or orpo): the trainer's steps over pairs.

`PreferenceTrainer` is the `Trainer` with these differences, each a method of its own:
- the batch counts pairs, two rows each (`megacore.data.pairs`: chosen then rejected, whole in
  their rows), so a microbatch never splits a pair; a step's rows are `2 x global_batch_size`, cut
  after the longest sequence of the rank's batch (`_trimmed`). With `"packing": "pack"` a row holds
  whole pairs, as many as fit: the batch counts rows, and the step's pairs are counted on the
  device (one all-reduce, as a language model's counted tokens);
- the targets are the completions' tokens (their role code, `completion`); the engine sums each
  row's log-probabilities of them and hands them to the objective (`ParallelModel.rows_loss`,
  `megacore.models.preference`), whose mean over the batch's pairs is the loss;
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
from mega_train.trainer import Trainer
from megacore.artifacts.reader import parent_of
from megacore.config import is_adapter_tensor
from megacore.data.dataset import Batch, Dataset
from megacore.data.packing import PAD
from megacore.errors import UserError
from megacore.models.lora import adapters_off, adapters_swapped
from megacore.models.preference import METRICS, Preference, pair_losses, pair_metrics

REFERENCE_FILE = "reference-logps.safetensors"


class PreferenceTrainer(Trainer):
    """One rank's part of a preference run (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        spec = self.run.objective
        self.objective = Preference(spec.type, spec.beta, spec.loss, spec.label_smoothing, spec.gamma)
        self.packed = self.plan.packs_pairs
        self.pairs = self.G  # the batch counts pairs (or, packed, rows: `global_count`)
        self.G = self.plan.rows_per_sample * self.pairs  # and the data rows
        self._count: torch.Tensor | int = self.pairs  # the pairs of the batch in hand
        self.reference: dict[str, torch.Tensor] = {}  # "train", "valid": [batches, rows]
        self.reference_adapters: list[torch.Tensor] = []  # a live reference's adapter values
        par = self.run.parallel
        fixed = par.pp > 1 or self.plan.compiles(torch.cuda.is_available())
        self.seq_multiple = None if fixed else math.lcm(8, self.plan.dims.seq_multiple(par.sequence_parallel))
        self._sums: dict[int, torch.Tensor] = {}  # each microbatch's metric sums, of a step or evaluation

    def _open_data(self) -> None:
        super()._open_data()
        self.train_role = self.plan.data[0][1].roles["completion"]
        self.assistant_code = None
        self.slots = max(d.pair_slots for d in (self.train_data, self.valid_data) if d is not None)
        if self.rank == 0 and self.train_data.skipped_pairs:
            what = "are, both sides together," if self.packed else "have a side"
            say(
                f"mega-train: warning: {self.train_data.skipped_pairs} pairs of the train split {what} "
                f"longer than seq_length + 1 = {self.S + 1} tokens and are left out"
            )

    def setup(self) -> None:
        super().setup()
        self.pm.row_slots = self.slots

    # --- the reference --------------------------------------------------------------------------

    def resume(self) -> None:
        ref = self.plan.reference
        if ref is not None and not ref.live:
            self.reference = self._stored_reference() or self._compute_reference()
        elif ref is not None and ref.kind == "adapters":  # live: their values kept, to be swapped in
            self._load_weights(ref.path, only=is_adapter_tensor)
            self.reference_adapters = [p.detach().clone() for p in self.params]
        super().resume()

    def _reference_key(self) -> str:
        """What the reference's log-probabilities depend on: the init checkpoint, the data and how
        the rows are drawn from it, the precision, how many batches."""
        run, plan = self.run, self.plan
        blob = {
            "init": parent_of(plan.init[0]).manifest_sha256,
            "sources": [parent_of(p).manifest_sha256 for p, _, _ in plan.data],
            "weights": [w for _, _, w in plan.data],
            "split": run.data.split, "seq_length": self.S, "rows": self.G, "seed": run.seed,
            "train": run.train_steps, "valid": run.eval.iters if run.eval.every else 0,
            "precision": run.precision, "lora": plan.lora is not None, "packed": self.packed,
            **plan.reference.key(),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()

    def _stored_reference(self) -> dict[str, torch.Tensor] | None:
        """The stored log-probabilities when they are this run's (same key), else None."""
        from safetensors import safe_open

        path = self.plan.out / REFERENCE_FILE
        if not path.is_file():
            return None
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if meta.get("producer") != PRODUCER:
                raise UserError(f"{path} was not written by mega-train; move it out of the run directory")
            if meta.get("key") != self._reference_key():
                return None
            return {k: f.get_tensor(k).to(self.device) for k in f.keys()}  # noqa: SIM118 (safe_open)

    def _compute_reference(self) -> dict[str, torch.Tensor]:
        """The reference's log-probabilities of every train and valid row (collective), written
        by rank 0 (replacing an earlier run's, whose key differs)."""
        ref = self.plan.reference
        base = (lambda name: not is_adapter_tensor(name)) if self.plan.lora is not None else None
        # A whole model in the base's place (read once, not over init's), or adapters on init's base.
        self._load_weights(ref.path if ref.kind == "model" else self.plan.init[0], only=base)
        if ref.kind == "adapters":
            self._load_weights(ref.path, only=is_adapter_tensor)
        with self._as_reference():
            out = {"train": self._logps(self.train_data, self.run.train_steps)}
            if self.valid_data is not None:
                out["valid"] = self._logps(self.valid_data, self.run.eval.iters)
        if self.rank == 0:
            from safetensors.torch import save_file

            path = self.plan.out / REFERENCE_FILE
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
        stack = ExitStack()
        ref = self.plan.reference
        if ref.kind == "adapters" and ref.live:
            stack.enter_context(adapters_swapped(self.params, self.reference_adapters))
        elif ref.kind != "adapters":
            for part in self.pm.parts if self.plan.lora is not None else ():
                stack.enter_context(adapters_off(part))
        return stack

    def _logps(self, data: Dataset, batches: int) -> torch.Tensor:
        """The model's summed log-probability of every side's completion, [batches, rows x slots],
        on every rank: each dp rank's rows from the ranks that report them, added up over the
        world."""
        table = torch.zeros(batches, self.G * self.slots, dtype=torch.float64, device=self.device)
        n = self.G // self.dp * self.slots
        for k in range(batches):
            mine = self._batch_logps(data, k)
            if self.pm.reports_logits:
                table[k, self.dp_rank * n : (self.dp_rank + 1) * n] = mine
        dist.all_reduce(table)
        return table

    def _batch_logps(self, data: Dataset, k: int) -> torch.Tensor | None:
        """The model's summed log-probability of each side of this rank's rows of batch k
        (collective; None where no stage computes them)."""
        got: dict[int, torch.Tensor] = {}

        def keep(logps: torch.Tensor, counted: torch.Tensor, i: int) -> torch.Tensor:
            got[i] = logps.detach().double()
            return logps.sum()

        self.pm.rows_loss = keep
        tokens, targets, positions, _ = self.batch(self.rows(data, k), self.train_role)
        self.pm.evaluate(tokens, targets, positions=positions)
        self.pm.rows_loss = None
        return torch.cat([got[i] for i in sorted(got)]) if got else None

    # --- steps and evaluation -------------------------------------------------------------------

    def batch(self, b: Batch, role: int | None) -> tuple:
        """The Trainer's, counting this rank's pairs (packed: the sides' first tokens, halved; a
        device tensor), cut after its longest sequence."""
        inputs, targets, positions, _ = super().batch(self._trimmed(b), role)
        if not self.packed:
            return inputs, targets, positions, b.tokens.shape[0] // 2
        sides = int(((b.positions == 0) & (b.tokens != PAD)).sum())
        return inputs, targets, positions, torch.tensor(sides // 2, device=self.device)

    def _trimmed(self, b: Batch) -> Batch:
        """The batch without the columns after its longest sequence, which are padding in every
        row (a row holds one sequence from its start), kept to a multiple of `seq_multiple`: the
        same losses, and no compute spent on padding (TRL pads each batch to its longest too).
        Not under a pipeline, whose stages' shapes are fixed at the first step, nor compiled."""
        if self.seq_multiple is None:
            return b
        longest = int((b.tokens != PAD).sum(1).max())
        keep = min(self.S, -(-(longest - 1) // self.seq_multiple) * self.seq_multiple) + 1
        cut = [None if a is None else a[:, :keep] for a in b]
        return Batch(*cut)

    def global_count(self, counted: torch.Tensor | int) -> torch.Tensor | int:
        """The batch's pairs: known unless packed (then the dp ranks' added up)."""
        self._count = super().global_count(counted) if self.packed else self.pairs
        return self._count

    def _use(self, which: str, k: int) -> None:
        """The objective for batch k of `which`, its reference rows by microbatch."""
        refs: list[torch.Tensor] | None = None
        if self.reference:
            n = self.G // self.dp * self.slots
            mine = self.reference[which][k, self.dp_rank * n : (self.dp_rank + 1) * n]
            refs = list(mine.to(torch.float32).chunk(self.pm.par.microbatches))
        elif self.objective.needs_reference:  # live: the reference now, from the model in memory
            with self._as_reference():
                mine = self._batch_logps(self.train_data if which == "train" else self.valid_data, k)
            refs = None if mine is None else list(mine.to(torch.float32).chunk(self.pm.par.microbatches))
        self._sums = {}

        def rows_loss(logps: torch.Tensor, counted: torch.Tensor, i: int) -> torch.Tensor:
            ref = refs[i].to(logps.dtype) if refs is not None else None
            loss, stats = pair_losses(self.objective, logps.float(), counted, ref)
            self._sums[i] = pair_metrics(stats.double())  # a repeated microbatch replaces its sums
            return loss.sum()

        self.pm.rows_loss = rows_loss

    def _metrics(self) -> dict[str, torch.Tensor]:
        """TRL's metrics of the last batch, over every rank's pairs (one all-reduce)."""
        total = torch.zeros(len(METRICS), dtype=torch.float64, device=self.device)
        if self.pm.reports_logits and self._sums:
            total += torch.stack(list(self._sums.values())).sum(0)
        dist.all_reduce(total)
        return dict(zip(METRICS, total / self._count, strict=True))

    def step(self) -> bool:
        self._use("train", self.position.step)
        stopping = super().step()
        self.pending[-1].device.update(self._metrics())
        return stopping

    def evaluate(self) -> dict[str, float]:
        """The objective's loss and TRL's metrics over the first `eval.iters` valid batches."""
        losses, sums = [], {}
        for k in range(self.run.eval.iters):
            self._use("valid", k)
            tokens, targets, positions, counted = self.batch(self.rows(self.valid_data, k), self.train_role)
            self.global_count(counted)
            loss = self.pm.evaluate(tokens, targets, positions=positions)
            losses.append(self.reduce_loss(loss if self.pm.has_last else None, counted)[0])
            for name, v in self._metrics().items():
                sums[name] = sums.get(name, 0.0) + v
        values = torch.stack([*losses, *sums.values()]).tolist()
        iters = self.run.eval.iters
        return {
            "loss": sum(values[:iters]) / iters,
            **{k: v / iters for k, v in zip(sums, values[iters:], strict=True)},
        }

    def eval_record(self, ev: dict[str, float]) -> dict:
        self.position.metrics["valid_loss"] = ev["loss"]
        return {"step": self.position.step, "kind": "eval", **ev}
