"""A run's samples as the trainer reads them: the train and valid sample indexes
(`megacore.data.Dataset`: global batch k is samples k·G..(k+1)·G−1, whatever the layout), built
once for all ranks (`open_samples`), and which targets of them count (`loss_roles`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from mega_train.metrics import say
from mega_train.objectives import kind_of
from mega_train.run_checks import has_valid_split
from megacore.data.dataset import Dataset

if TYPE_CHECKING:
    from mega_train.run_plan import RunPlan


def open_samples(plan: RunPlan, rank: int, rows: int) -> tuple[Dataset, Dataset | None]:
    """The train and valid sample indexes (`rows`: a global batch's data rows, or its prompts for
    an objective that samples their completions; no valid one without held-out evaluation): rank 0 builds (or finds) them, the others then load them from
    the cache (collective)."""
    run, S = plan.run, plan.run.batch.seq_length
    batches, completion = run.train_steps, 0
    if kind_of(run).prompts:  # a batch's samples are prompts; its completions serve num_iterations steps
        rows, completion = run.batch.global_batch_size, run.objective.max_completion_length
        batches = -(-run.train_steps // run.objective.num_iterations)

    def build(which: str, samples: int) -> Dataset:
        return Dataset.build(
            plan.data, run.data.split, which, S, samples, run.seed, plan.out / "data-index",
            packing=run.data.packing, doc_mask=run.data.doc_mask, completion_length=completion,
        )  # fmt: skip

    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            train = build("train", batches * rows)
            held_out = run.eval.every and has_valid_split(run)  # lm-eval's tasks alone need none
            valid = build("valid", run.eval.iters * rows) if held_out else None
        dist.barrier()
    if rank == 0 and train.truncated:
        say(
            f"mega-train: warning: {train.truncated} conversations of the train split are "
            f"longer than seq_length + 1 = {S + 1} tokens and are cut to it"
        )
    return train, valid


def loss_roles(plan: RunPlan, valid: Dataset | None) -> tuple[int | None, int | None]:
    """The role code whose targets alone the train loss counts (`loss_on: assistant`), else None;
    and the assistant's code that evaluation also reports alone, for chat data trained on every
    token, else None."""
    roles = plan.data[0][1].roles
    # Loss on the assistant's tokens only: their role code (the plan checked every source has it).
    train_role = roles["assistant"] if plan.run.data.loss_on == "assistant" else None
    # Chat data trained on every token: evaluation also reports the assistant's tokens alone.
    chat = valid is not None and valid.has_roles and valid.has_positions
    return train_role, roles.get("assistant") if chat and train_role is None else None
