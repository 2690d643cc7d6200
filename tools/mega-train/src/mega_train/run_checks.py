"""A run's settings checked against each other and against its model and data, without torch: the
sequence length, the attention kernel, the learning rates and held-out evaluation
(`check_schedule`), and what runs at the evaluations besides the loss: samples and lm-eval's tasks
(`check_generation`).
"""

from __future__ import annotations

from pathlib import Path

from megacore.artifacts import RunManifest, TokensManifest, resolve_ref
from megacore.config import ModelConfig
from megacore.errors import UserError


def check_schedule(run: RunManifest, config: ModelConfig, from_init: bool, where: str) -> None:
    """Sequence length, attention kernel, learning rates and evaluation agree with each other."""
    b, opt = run.batch, run.optimizer
    if b.seq_length > config.max_seq_len:
        at = "$.model" if from_init else "$.model.config"
        raise UserError(
            f"$.batch.seq_length: {b.seq_length} exceeds the model's max_seq_len {config.max_seq_len}, the "
            f"context its positions were trained for; to train a longer context set {at}.max_seq_len "
            f"(with {at}.rope_scaling: docs/mega-train.md, Longer context)",
            where,
        )
    if run.attention == "flash" and run.precision == "fp32":
        raise UserError(
            "$.attention: 'flash' (FlashAttention kernels) runs in bf16 or fp16, and $.precision is fp32",
            where,
        )
    if run.attention == "flash" and config.latent is None and config.attention.sinks:
        raise UserError(
            "$.attention: 'flash': the model has attention sinks (gpt-oss) and no FlashAttention "
            "kernel here has a sink (nor its backward); use auto or sdpa",
            where,
        )
    if opt.min_lr > opt.lr:
        raise UserError(f"$.optimizer.min_lr: {opt.min_lr} is above lr {opt.lr}", where)
    if opt.warmup_steps > run.train_steps:
        raise UserError(
            f"$.optimizer.warmup_steps: {opt.warmup_steps} exceeds train_steps {run.train_steps}", where
        )
    if run.eval.every and not run.eval.tasks and not has_valid_split(run):
        raise UserError(
            f"$.eval.every: evaluation needs a valid split, and $.data.split {run.data.split} gives it "
            "no documents; set eval.every to 0 or give the valid split a fraction",
            where,
        )


def check_generation(
    run: RunManifest, sources: list[tuple[Path, TokensManifest, float]], base: Path, where: str
) -> list[Path]:
    """`eval.samples` and `eval.tasks` can run (lm-eval installed, and knowing every task: it is
    imported only then); returns `eval.task_paths` resolved."""
    spec = run.eval
    chat = sources[0][1].format == "chat"
    for i, prompt in enumerate(spec.samples.prompts if spec.samples is not None else []):
        if not isinstance(prompt, str) and not chat:
            raise UserError(
                f"$.eval.samples.prompts[{i}]: a conversation needs chat data's template, and "
                f"$.data.sources[0] is {sources[0][1].format} data: give the prompt as text",
                where,
            )
    paths = [resolve_ref(base, p) for p in spec.task_paths]
    if paths and not spec.tasks:
        raise UserError("$.eval.task_paths: no $.eval.tasks to run from them", where)
    if spec.tasks and not spec.every:
        raise UserError("$.eval.tasks run at the evaluations: set $.eval.every (steps)", where)
    if spec.tasks:
        try:
            from mega_train.harness import check_tasks
        except ImportError as e:
            raise UserError(
                f"$.eval.tasks: lm-evaluation-harness is not installed ({e}): pip install 'mega-train[eval]'",
                where,
            ) from None
        check_tasks(spec.tasks, paths, where)
    return paths


def has_valid_split(run: RunManifest) -> bool:
    """Whether `data.split` gives the valid split documents (held-out evaluation's)."""
    return len(run.data.split) > 1 and run.data.split[1] > 0
