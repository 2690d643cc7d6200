"""Online RL from verifiable rewards (`objective` grpo): the model writes completions of the batch's
prompts, its reward functions score them, and it learns from its own scored samples.

A batch counts prompts (tokens of `mega-tokenize --format prompts`); every `num_iterations` steps
a new batch of them is rolled out (`Rollout`), and the steps between reuse it:
- every rank samples every completion of the batch, each prompt `num_generations` times, with the
  sampler (`megacore.parallel.sampler`) and a seed of the completion's own (the run's seed, the
  batch, its place in the batch), so the completions are the same in every layout; data
  parallelism splits the training rows, not the sampling (the sampler's forwards are collectives);
- every rank scores every completion with the reward functions (`mega_train.rewards`: TRL's
  signature, the prompt as the data gave it, the completion's text and ids, the row's columns),
  so the advantages (`megacore.models.grpo.group_advantages`) need no gathering; a function that
  raises stops the run with its one line;
- a row holds a prompt and one completion, the completion's tokens its targets, and each token's
  weight is fixed from the batch's lengths (`grpo.token_weights`); this rank's rows go to the
  engine with `megacore.parallel.policy_loss.PolicyLoss`;
- with `num_iterations` > 1 the sampling policy's log-probabilities of the rows are computed once
  before the batch's first update; with `beta` > 0 the reference's, by the base with its adapters
  off under LoRA, else by a frozen copy of `model.init` (`setup`).
Each step's record carries TRL's metrics (`reward`, `reward_std`, `rewards/<name>/mean` and `/std`,
`frac_reward_zero_std`, `completions/mean_length`, `completions/clipped_ratio`, `kl` with beta, `entropy`,
`clip_ratio/low_mean`, `/high_mean`, `/region_mean`) and the step's time split (`time/generation_s`,
`time/scoring_s`: the rollout's, 0 on a step that reuses it; `time/training_s`: the rest). Evaluation
samples the valid prompts' completions the same way and reports their rewards.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from mega_train.metrics import say
from mega_train.objectives.base import Objective
from mega_train.rewards import RewardError, load_rewards, score
from mega_train.sampling import stop_ids
from megacore.config import CONTEXT_FIELDS, TOKEN_ID_FIELDS
from megacore.data.dataset import Dataset
from megacore.data.packing import IGNORE
from megacore.data.prompts import PromptColumns
from megacore.errors import UserError
from megacore.models.grpo import STATS, Clip, group_advantages, nanstd, token_weights
from megacore.models.hf_tokenizer import load_tokenizer, trained_tokenizer_files
from megacore.models.lora import adapters_off
from megacore.models.sampling import Sampling
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.losses import Loss
from megacore.parallel.policy_loss import PolicyInputs, PolicyLoss, TokenLogps
from megacore.parallel.sampler import sample_parallel


@dataclass
class Rollout:
    """One batch of prompts' completions, scored: the whole batch's (every rank holds it) and this
    rank's rows as the engine takes them."""

    index: int  # the batch of prompts
    tokens: torch.Tensor  # this rank's rows' inputs [rows, S]
    targets: torch.Tensor  # their targets: the completions' tokens, IGNORE elsewhere
    advantages: torch.Tensor  # per row of this rank
    weights: torch.Tensor  # per row of this rank: its tokens' weight x the batch's completions
    old: torch.Tensor | None = None  # the sampling policy's log-probabilities [rows, S]
    ref: torch.Tensor | None = None  # the reference's
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    table: list[dict] = dataclasses.field(default_factory=list)  # every completion, for `rollout` records
    # Seconds the sampler took, and the reward functions with the advantages.
    generation_s: float = 0.0
    scoring_s: float = 0.0


class GRPOObjective(Objective):
    """The grpo objective's run half (module docstring)."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        spec = trainer.run.objective
        self.spec = spec
        self.clip = Clip(spec.epsilon, spec.epsilon_high or spec.epsilon, spec.beta,
                         spec.importance_sampling_level == "sequence")  # fmt: skip
        self.sampling = Sampling(spec.temperature, spec.top_k or None, spec.top_p if spec.top_p < 1 else None)
        specs = [msgspec.structs.asdict(r) for r in spec.rewards]
        self.rewards = load_rewards(specs, trainer.plan.path.parent, "$.objective.rewards")
        self.rollout: Rollout | None = None
        self.reference: ParallelModel | None = None
        self._loss: PolicyLoss | None = None
        self._inputs: dict[int, PolicyInputs] = {}
        self._times = (0.0, 0.0, 0.0)  # this step's generation and scoring seconds, and its start

    def roles(self, valid: Dataset | None) -> tuple[None, None]:
        return None, None  # the targets are the completions, made here

    def open_data(self) -> None:
        t = self.t
        files = trained_tokenizer_files(*t.plan.tokenizer, t.plan.config)
        self.tokenizer, self.stops = load_tokenizer(files), stop_ids(files)
        self.columns = [PromptColumns(path, m) for path, m, _ in t.plan.data]
        if t.rank == 0 and t.train_data.skipped_prompts:
            say(
                f"mega-train: warning: {t.train_data.skipped_prompts} prompts of the train split leave "
                f"no room for {self.spec.max_completion_length} completion tokens in seq_length "
                f"{t.S} and are left out"
            )

    def setup(self) -> None:
        """With beta > 0 and no LoRA: the reference, a frozen copy of the model the run starts from."""
        t = self.t
        if not self.spec.beta or t.plan.lora is not None:
            return
        par = dataclasses.replace(t.pm.par, compile=False)
        self.reference = ParallelModel(t.plan.config, par, t.mesh, t.device)
        for p in self.reference.parameters():
            p.requires_grad_(False)
        load_checkpoint(t.plan.init[0], self.reference, ignore=(*TOKEN_ID_FIELDS, *CONTEXT_FIELDS))
        self.reference.refresh()

    # --- a step ---------------------------------------------------------------------------------

    def consumed(self, steps: int) -> int:
        """The prompts `steps` steps have read: a batch of them every `num_iterations` steps."""
        return -(-steps // self.spec.num_iterations) * self.t.samples

    def step_rows(self, step: int) -> tuple:
        """This step's rows: a new batch of completions every `num_iterations` steps."""
        t = self.t
        k = step // self.spec.num_iterations
        self._times = (0.0, 0.0, time.perf_counter())
        if self.rollout is None or self.rollout.index != k:
            try:
                self.rollout = self._roll_out(t.train_data, k, train=True)
            except RewardError as e:  # every rank scores alike: all save, then stop with its line
                t.flush()
                t.save_now()
                raise UserError(
                    f"$.objective.rewards: {e} (step {t.position.step} saved)", str(t.plan.path)
                ) from None
            self._times = (self.rollout.generation_s, self.rollout.scoring_s, self._times[2])
            every = t.run.logging.every
            if t.position.step == 0 or (t.position.step + 1) % every == 0:
                for row in self.rollout.table:
                    t.report({"step": t.position.step + 1, "kind": "rollout", **row})
        r = self.rollout
        self._split(r)
        return r.tokens, r.targets, None, r.tokens.shape[0]

    def global_count(self, counted: torch.Tensor | int) -> int:
        """The batch's completions: what the token weights were scaled by."""
        return self.spec.num_generations * self.t.run.batch.global_batch_size

    def loss(self, which: str, k: int) -> Loss | None:
        """The step's loss; its per-token inputs come with the step's rows (`batch`, called next)."""
        pm = self.t.pm
        self._inputs = {}
        self._loss = PolicyLoss(
            pm.config.vocab_size, pm.tp_mesh, self.clip, self.spec.temperature, self._inputs
        )
        return self._loss

    def _split(self, r: Rollout) -> None:
        """The rollout's per-row inputs, microbatch by microbatch, for the step's loss."""
        n = self.t.pm.par.microbatches
        chunks = [torch.chunk(a, n) if a is not None else [None] * n
                  for a in (r.old, r.ref, r.advantages, r.weights, r.targets)]  # fmt: skip
        for i, (old, ref, adv, w, tg) in enumerate(zip(*chunks, strict=True)):
            rows = torch.arange(tg.shape[0], device=tg.device)[:, None].expand_as(tg)
            self._inputs[i] = PolicyInputs(
                old, ref, adv[:, None].expand_as(tg), w[:, None].expand_as(tg), rows
            )

    def metrics(self) -> dict[str, torch.Tensor]:
        """The rollout's metrics (every rank holds them) and the loss's, added up over the ranks that
        compute it once (`reports_logits`: the last stage's, at tp rank 0)."""
        t = self.t
        generation, scoring, start = self._times
        times = {
            "time/generation_s": generation,
            "time/scoring_s": scoring,
            "time/training_s": time.perf_counter() - start - generation - scoring,
        }
        out = {
            k: torch.tensor(v, dtype=torch.float64, device=t.device)
            for k, v in {**self.rollout.metrics, **times}.items()
        }
        n = len(STATS)
        sums = torch.zeros(2 * n, dtype=torch.float64, device=t.device)
        if t.pm.reports_logits and self._loss is not None:
            for s in self._loss.stats.values():
                sums += torch.cat([s.sums, s.counts]).double()
        dist.all_reduce(sums)
        for j, name in enumerate(STATS):
            if name != "kl" or self.spec.beta:
                out[name] = sums[j] / sums[n + j].clamp(min=1)
        return out

    # --- rollouts -------------------------------------------------------------------------------

    def _roll_out(self, data: Dataset, k: int, train: bool) -> Rollout:
        """Batch k of `data`: every completion sampled and scored, this rank's rows made."""
        t, spec = self.t, self.spec
        G, P = spec.num_generations, t.run.batch.global_batch_size
        b = data.batch(k * P, (k + 1) * P)
        prompts = [data.sources[int(j)].docs.tokens(int(d)).tolist() for j, d in b.documents]
        seeds = np.random.SeedSequence([t.run.seed % 2**64, int(train), k]).generate_state(P * G, np.uint64)
        start = time.perf_counter()
        completions = sample_parallel(
            t.pm, [p for p in prompts for _ in range(G)], spec.max_completion_length, self.sampling,
            self.stops, where="$.objective", seeds=[int(s) % 2**63 for s in seeds],
        )  # fmt: skip
        sampled = time.perf_counter()
        values, given, texts = self._scores(b.documents, completions)
        advantages, rewards, zero_std = group_advantages(values, self._weights(), G, spec.scale_rewards)
        scored = time.perf_counter()
        lengths, clipped = self._lengths(completions)
        metrics = self._rollout_metrics(values, rewards, zero_std, lengths, clipped)
        share = slice(t.dp_rank * P * G // t.dp, (t.dp_rank + 1) * P * G // t.dp)
        tokens, targets = self._rows(
            [p for p in prompts for _ in range(G)][share], completions[share], lengths[share]
        )
        weights = token_weights(torch.tensor(lengths), spec.loss, spec.max_completion_length) * (P * G)
        as_rows = {"dtype": torch.float32, "device": t.device}
        r = Rollout(
            k, tokens, targets, advantages[share].to(**as_rows), weights[share].to(**as_rows), metrics=metrics,
            generation_s=sampled - start, scoring_s=scored - sampled,
        )  # fmt: skip
        r.table = [
            {"prompt": p, "completion": x, "completion_ids": c, "reward": float(rw), "advantage": float(a),
             "rewards": {f.name: None if v != v else float(v) for f, v in zip(self.rewards, vs.tolist(), strict=True)}}
            for p, x, c, rw, a, vs in zip(given, texts, completions, rewards, advantages, values, strict=True)
        ]  # fmt: skip
        if train:
            self._log_probs(r)
        return r

    def _weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)

    def _scores(self, documents: np.ndarray, completions: list[list[int]]) -> tuple[torch.Tensor, list, list]:
        """Every completion's value from every reward function [N, functions] (NaN: None), and the
        prompts (as the data gave them) and the completions' texts the functions were given."""
        G = self.spec.num_generations
        columns: dict[str, list] = {}
        for j, d in documents:
            row = self.columns[int(j)].rows([int(d)])
            for name in {*columns, *row}:
                columns.setdefault(name, []).extend(row.get(name, [None]) * G)
        given = columns.pop("prompt")
        chat = isinstance(given[0], list)
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        shown = [[{"role": "assistant", "content": x}] for x in texts] if chat else texts
        s = score(self.rewards, given, shown, completions, columns)
        values = torch.tensor(
            [[float("nan") if v is None else v for v in s.by_name[r.name]] for r in self.rewards],
            dtype=torch.float64,
        ).T
        return values, given, texts

    def _lengths(self, completions: list[list[int]]) -> tuple[list[int], list[bool]]:
        """Each completion's counted tokens, and whether it was cut at max_completion_length."""
        cut = [len(c) == self.spec.max_completion_length and c[-1] not in self.stops for c in completions]
        if self.spec.mask_truncated_completions:
            return [0 if x else len(c) for c, x in zip(completions, cut, strict=True)], cut
        return [len(c) for c in completions], cut

    def _rows(self, prompts: list[list[int]], completions: list[list[int]], lengths: list[int]) -> tuple:
        """Rows [prompt, completion, padding] as inputs and targets (the counted completion tokens,
        IGNORE elsewhere), as wide as the longest of this rank's rows needs (rounded up to a multiple
        of 8, at most seq_length): no compute on padding, as TRL pads each batch to its longest."""
        longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
        S = min(self.t.S, -(-longest // 8) * 8)
        rows = np.zeros((len(prompts), S + 1), dtype=np.int64)
        targets = np.full((len(prompts), S), IGNORE, dtype=np.int64)
        for i, (p, c, n) in enumerate(zip(prompts, completions, lengths, strict=True)):
            rows[i, : len(p) + len(c)] = p + c
            targets[i, len(p) - 1 : len(p) - 1 + n] = c[:n]
        return self.t.to_device(rows[:, :-1]), self.t.to_device(targets)

    def _log_probs(self, r: Rollout) -> None:
        """The sampling policy's (num_iterations > 1) and the reference's (beta > 0) log-probabilities
        of the rollout's rows."""
        t = self.t
        if self.spec.num_iterations > 1:
            r.old = self._forward(t.pm, r)
        if self.spec.beta:
            r.ref = self._forward(self.reference or t.pm, r, base=self.reference is None)

    def _forward(self, model: ParallelModel, r: Rollout, base: bool = False) -> torch.Tensor:
        """Each target's log-probability [rows, S] at the sampling temperature under `model` (with
        `base`, its adapters off), on every rank."""
        logps = TokenLogps(model.config.vocab_size, model.tp_mesh, self.spec.temperature)
        with ExitStack() as stack:
            for part in model.parts if base else []:  # LoRA's reference: the base, adapters off
                stack.enter_context(adapters_off(part))
            model.evaluate(r.tokens, r.targets, loss=logps)
        return logps.rows()

    def _rollout_metrics(self, values, rewards, zero_std, lengths, clipped) -> dict[str, float]:
        out = {"reward": _nanmean(rewards), "reward_std": _nanstd(rewards),
               "frac_reward_zero_std": float(zero_std.double().mean())}  # fmt: skip
        for j, r in enumerate(self.rewards):
            out[f"rewards/{r.name}/mean"] = _nanmean(values[:, j])
            out[f"rewards/{r.name}/std"] = _nanstd(values[:, j])
        out["completions/mean_length"] = float(np.mean(lengths))
        out["completions/clipped_ratio"] = float(np.mean(clipped))
        return out

    # --- evaluation -----------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The valid prompts' completions' rewards, over the first `eval.iters` batches."""
        t = self.t
        records = [self._roll_out(t.valid_data, k, train=False).metrics for k in range(t.run.eval.iters)]
        keys = [k for k in records[0] if k == "reward" or k.startswith("rewards/")]
        return {k: float(np.nanmean([m[k] for m in records])) for k in keys}

    def eval_record(self, ev: dict[str, float]) -> dict:
        return {"step": self.t.position.step, "kind": "eval", **ev}


def _nanmean(x: torch.Tensor) -> float:
    return float(torch.nanmean(x.double())) if not x.isnan().all() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    """`grpo.nanstd` of the values that are not NaN, 0 with fewer than two."""
    x = x.double()
    return float(nanstd(x)) if int((~x.isnan()).sum()) > 1 else 0.0
