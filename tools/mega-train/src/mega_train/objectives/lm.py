"""Language modelling, the default objective: next-token cross entropy, the mean over the global
batch's counted targets (the engine's own loss), evaluated as loss, perplexity, next-token accuracy
and the user's `eval.metrics` (`mega_train.evaluation`); on chat data trained on every token, the
assistant's tokens are reported apart too."""

from __future__ import annotations

import torch

from mega_train.evaluation import EvalSums
from mega_train.metrics import perplexity
from mega_train.objectives.base import Objective
from megacore.data.packing import inputs_and_targets


class LanguageModelling(Objective):
    """The engine's cross entropy, and the evaluation above."""

    def evaluate(self) -> dict[str, float]:
        """Loss, accuracy and the user's metrics over the first `eval.iters` valid batches (the
        same ones in every layout and resume), on every rank."""
        t = self.t
        pm, run = t.pm, t.run
        sums = EvalSums(run.eval.metrics, t.plan.eval_metrics, str(t.plan.path))
        for k in range(run.eval.iters):
            b = t.rows(t.valid_data, k)
            tokens, targets, positions, counted = self.batch(b, t.train_role)
            on_logits = sums.add_logits
            if t.assistant_code is not None and pm.reports_logits:
                # Chat data with the loss on every token: the assistant's tokens reported apart too,
                # microbatch by microbatch, in the order evaluate goes through them.
                assistant = inputs_and_targets(b.tokens, b.positions, b.roles, t.assistant_code)[2]
                parts = iter(torch.from_numpy(assistant).to(t.device).chunk(pm.par.microbatches))

                def on_logits(logits: torch.Tensor, tg: torch.Tensor, parts=parts) -> None:
                    sums.add_logits(logits, tg)
                    sums.add_assistant(logits, next(parts))

            loss = pm.evaluate(tokens, targets, on_logits, positions)
            if pm.reports_logits:  # one rank per dp rank, like the metrics
                sums.add_loss(float(loss), int(counted))
        return sums.combine()

    def eval_record(self, ev: dict[str, float]) -> dict:
        loss = ev.pop("loss")
        self.t.position.metrics["valid_loss"] = loss
        record = {"step": self.t.position.step, "kind": "eval", "loss": loss, "ppl": perplexity(loss)}
        record.update(ev)  # accuracy, the user's metrics, the assistant's (chat data)
        if "assistant_loss" in record:
            record["assistant_ppl"] = perplexity(record["assistant_loss"])
        return record
