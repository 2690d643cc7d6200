"""W&B logging on rank 0, when `logging.wandb_project` is set and `logging.wandb_mode` is `online`
or `offline` (offline writes the run locally, no network; `wandb sync` uploads it later).

The run's config is the plan and the manifest; each metrics.jsonl record is logged at its step as
`train/<field>` or `eval/<field>`, lm-eval's scores as `eval_task/<task>/<metric>` and samples as
the table `samples`. The W&B run id is kept in `<out>/wandb-run-id`, so a resumed
run continues the same W&B run (a fresh start gets a new one); W&B's own files go to `<out>/wandb`.
W&B reads its API key (WANDB_API_KEY or its netrc) itself: this module never touches it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from megacore.artifacts.writer import write_file_atomic
from megacore.errors import UserError

if TYPE_CHECKING:
    from mega_train.run_plan import RunPlan

RUN_ID_FILE = "wandb-run-id"


class WandbLog:
    """An open W&B run: `log` records, then `finish`."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.samples: list[list] = []  # every sample so far: W&B's table is logged whole each time
        self.rollouts: list[list] = []  # online RL's completions, likewise

    @staticmethod
    def open(plan: RunPlan, resumed: bool) -> WandbLog | None:
        """Start (or, when `resumed`, continue) the run's W&B run; None when W&B is off."""
        spec = plan.run.logging
        if spec.wandb_project is None or spec.wandb_mode == "disabled":
            return None
        import wandb  # only here: it takes a second to import

        id_file = plan.out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else ""
        config = {
            **plan.summary(),
            "manifest": msgspec.to_builtins(plan.run),
            "model_config": msgspec.to_builtins(plan.config),
        }
        try:
            run = wandb.init(
                project=spec.wandb_project,
                id=run_id or None,  # None: a new run, its id kept below
                resume="allow",
                dir=str(plan.out),
                mode=spec.wandb_mode,
                config=config,
            )
        except Exception as e:
            why = f"{type(e).__name__}: {e}".replace("\n", " ")
            raise UserError(f"$.logging: W&B did not start ({why})", str(plan.path)) from None
        write_file_atomic(id_file, f"{run.id}\n".encode())
        return WandbLog(run)

    def log(self, record: dict) -> None:
        """A metrics.jsonl record at its step; fields without a value are left out. An lm-eval
        score as `eval_task/<task>/<metric>`; samples and rollouts as tables (`_table`)."""
        prefix = record["kind"]
        if prefix == "eval_task":
            self.run.log(
                {f"eval_task/{record['task']}/{record['metric']}": record["value"]}, step=record["step"]
            )
            return
        if prefix in ("sample", "rollout"):
            self._table(record)
            return
        values = {
            f"{prefix}/{k}": v
            for k, v in record.items()
            if k not in ("step", "kind") and isinstance(v, int | float) and not isinstance(v, bool)
        }
        self.run.log(values, step=record["step"])

    def _table(self, record: dict) -> None:
        """Samples as the table `samples` (step, prompt, completion: a conversation's prompt as
        JSON); online RL's completions as `rollouts`, with their reward."""
        import wandb

        prompt = record["prompt"] if isinstance(record["prompt"], str) else json.dumps(record["prompt"])
        row = [record["step"], prompt, record["completion"]]
        if record["kind"] == "sample":
            self.samples.append(row)
            table = wandb.Table(columns=["step", "prompt", "completion"], data=self.samples)
            self.run.log({"samples": table}, step=record["step"])
            return
        self.rollouts.append([*row, record["reward"]])
        table = wandb.Table(columns=["step", "prompt", "completion", "reward"], data=self.rollouts)
        self.run.log({"rollouts": table}, step=record["step"])

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
