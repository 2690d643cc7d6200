"""Samples while training (`eval.samples`): greedy completions of the manifest's prompts from the
live model in its layout (`megacore.parallel.generate`), every `every` steps and at the end, as
`sample` records: metrics.jsonl, the console and a W&B table.

Prompts become ids as the export's tokenizer makes them (the same files: `hf_tokenizer_files`),
which is what transformers' `generate` on the export is given: text as `tokenizer(text)` encodes
it, a conversation (and on chat data a text prompt, as one user turn) through the chat template
the data was rendered with, the assistant's turn opened. A completion ends at the export's
end-of-turn ids (generation_config.json's `eos_token_id`) or after `max_new_tokens`, and is
decoded without its special tokens. `open_generation` builds what samples and lm-eval's tasks
(`harness.py`) run on: the tokenizer and the live model's `Generator`, shared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from megacore.artifacts.run_spec import EvalSpec, SamplesSpec
from megacore.models.hf_tokenizer import load_tokenizer, trained_tokenizer_files
from megacore.parallel.engine import ParallelModel
from megacore.parallel.generate import Generator

if TYPE_CHECKING:
    from mega_train.harness import MegaLM
    from mega_train.run_plan import RunPlan


def stop_ids(files: dict[str, bytes]) -> set[int]:
    """The ids generation ends at, as the export's generation_config.json names them."""
    eos = json.loads(files["generation_config.json"]).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class Sampler:
    """`spec`'s prompts as ids, and their completions at a step (`records`; a collective)."""

    def __init__(
        self, spec: SamplesSpec, tokenizer, chat: bool, stops: set[int], generator: Generator
    ) -> None:
        self.spec, self.tokenizer, self.stops, self.generator = spec, tokenizer, stops, generator
        self.prompts = [p if isinstance(p, str) else msgspec.to_builtins(p) for p in spec.prompts]
        self.ids = [self._encode(p, chat) for p in self.prompts]

    def _encode(self, prompt: str | list[dict], chat: bool) -> list[int]:
        if isinstance(prompt, str) and not chat:
            return self.tokenizer(prompt)["input_ids"]
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=False)

    def due(self, step: int, last: int) -> bool:
        return step % self.spec.every == 0 or step == last

    def records(self, step: int) -> list[dict]:
        """Every prompt's completion at `step`, as `sample` records (on every rank)."""
        got = self.generator.greedy(self.ids, self.spec.max_new_tokens, self.stops)
        return [
            {"step": step, "kind": "sample", "prompt": prompt,
             "completion": self.tokenizer.decode(ids, skip_special_tokens=True)}
            for prompt, ids in zip(self.prompts, got, strict=True)
        ]  # fmt: skip


def sample_line(r: dict) -> str:
    """The console line of a `sample` record (the prompt's text, or its last turn's)."""
    prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
    return f"step {r['step']} sample | {json.dumps(prompt, ensure_ascii=False)} -> {json.dumps(r['completion'], ensure_ascii=False)}"


def open_generation(plan: RunPlan, pm: ParallelModel) -> tuple[Sampler | None, MegaLM | None]:
    """What the run's samples and lm-eval's tasks (`harness.py`) run on, where it asks for them: the
    data's tokenizer as the export's files, and the live model's generator (a collective)."""
    spec, config = plan.run.eval, plan.config
    if spec.samples is None and not spec.tasks:
        return None, None
    files = trained_tokenizer_files(*plan.tokenizer, config)
    tokenizer, generator = load_tokenizer(files), Generator(pm)
    sampler, lm = None, None
    if spec.samples is not None:
        chat = plan.data[0][1].format == "chat"
        sampler = Sampler(spec.samples, tokenizer, chat, stop_ids(files), generator)
    if spec.tasks:
        from mega_train.harness import MegaLM

        lm = MegaLM(pm, tokenizer, config.max_seq_len, generator=generator)
    return sampler, lm


def task_records(lm: MegaLM, spec: EvalSpec, paths: list[Path], step: int) -> list[dict]:
    """lm-eval's scores of the live model on `spec.tasks` as `eval_task` records (a collective:
    every rank runs them; where lm-eval reports, rank 0, the records)."""
    from mega_train.harness import run_tasks

    return [
        {"step": step, "kind": "eval_task", "task": task, "metric": metric, "value": value}
        for task, metric, value in run_tasks(lm, spec.tasks, paths, spec.limit)
    ]
