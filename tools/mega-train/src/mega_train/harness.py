"""lm-evaluation-harness on our model in any layout: `MegaLM`, an lm-eval model whose
log-likelihoods and greedy generations come from a `ParallelModel` (`megacore.parallel.generate`),
used two ways:

- in a run, `"eval": {"tasks": [...], "task_paths": [...], "limit": N, "every": M}`: the live model
  at every evaluation (`run_tasks`), each score an `eval_task` record;
- on any checkpoint after a run, with lm-eval's own command line and this model registered as
  `mega` (`main`): `python -m mega_train.harness --model mega --model_args pretrained=DIR,tp=2
  --tasks ...`, under torchrun for a layout of several processes.

Every rank runs the same evaluation (lm-eval sees one process, rank 0 of 1: the layout splits the
model's work, not the requests), so the model's collectives meet; lm-eval itself reports from
local rank 0 alone. Text becomes ids as lm-eval's `hf` model makes them from the same tokenizer
files mega-export writes (`tok_encode`, the prefix token of an empty context, rolling windows, the
stop sequences), so the scores are those of the `hf` model on the export. lm-eval is an optional
extra (`pip install 'mega-train[eval]'`); this module imports it.

The console stays quiet as the tools' does (`megacore.cli.quiet_libraries`): lm-eval's log lines,
its progress bars and its `git` call's complaint outside a repository are silenced, unless
`--debug` (taken out of lm-eval's arguments) or `MEGA_DEBUG=1`. A run records and prints the
scores alone: no standard errors (not computed) nor lm-eval's count of documents.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from megacore.cli import quiet_libraries, quieted, split_debug

# lm-eval's command line (`main`) with --debug or MEGA_DEBUG=1: the libraries' output and tracebacks
# shown. Quieted before torch is imported: it imports tqdm, which reads its switch then.
DEBUG = False
if __name__ == "__main__":
    sys.argv[1:], DEBUG = split_debug(sys.argv[1:])
    if not DEBUG:
        quiet_libraries()

import lm_eval.evaluator  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import model_registry  # noqa: E402
from lm_eval.loggers.utils import get_commit_from_path  # noqa: E402
from lm_eval.models.utils import (  # noqa: E402
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string  # noqa: E402

from megacore.errors import UserError  # noqa: E402
from megacore.parallel.engine import ParallelModel  # noqa: E402
from megacore.parallel.generate import Generator  # noqa: E402
from megacore.parallel.mesh import shutdown  # noqa: E402

BATCH = 16  # rows per forward when lm-eval gives no batch size
MAX_GEN_TOKS = 256  # lm-eval's `hf` model's default


class MegaLM(TemplateLM):
    """An lm-eval model over `pm` (every rank builds it alike) and its tokenizer (transformers')."""

    def __init__(
        self,
        pm: ParallelModel,
        tokenizer,
        max_length: int,
        batch_size: int = BATCH,
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        self.generator = generator if generator is not None else Generator(pm)
        self.tokenizer = tokenizer
        self._max_length, self.batch_size = max_length, batch_size

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MegaLM:
        """From lm-eval's `--model_args` `pretrained=DIR[,base=DIR,tp=N,pp=N,cp=N,ep=N,precision=fp32|bf16,
        attention=auto|sdpa|flash]`; `--batch_size` (a number) rows per forward."""
        from mega_train.checkpoint_model import open_checkpoint_model

        pm, tokenizer = open_checkpoint_model({k: str(v) for k, v in arg_dict.items()})
        size = (additional_config or {}).get("batch_size")
        batch = int(size) if str(size).isdigit() else BATCH
        return cls(pm, tokenizer, pm.config.max_seq_len, batch)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MegaLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = _add_special_kwargs(add_special_tokens, None)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **kw)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's; its bar (drawn whatever tqdm's default) off where the console is quiet."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or quieted())

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            ids = (context + continuation)[-(self.max_length + 1) :]
            rows.append((ids, len(continuation)))
        out = []
        for i in range(0, len(rows), self.batch_size):
            out += self.generator.score(rows[i : i + self.batch_size])
        for (key, _, _), answer in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in (req.args for req in requests):
            windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            out.append(sum(logp for logp, _ in self._loglikelihood_tokens(windows)))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy completions, `batch_size` requests with the same generation arguments at a time."""
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
        out = [""] * len(args)
        for rows in groups.values():
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start : start + self.batch_size]
                for i, text in zip(
                    batch, self._generate([args[i][0] for i in batch], args[batch[0]][1]), strict=True
                ):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        """The `hf` model's greedy generation of `contexts` under one request's arguments: at most
        `max_gen_toks` new ids, each completion cut at the first stop sequence it holds."""
        kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
        if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
            raise UserError("lm-eval asked for sampled generation; the mega model generates greedily")
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode(self.eot_token_id))
        new = kwargs.pop("max_gen_toks")
        ids = [self.tok_encode(c, left_truncate_len=self.max_length - new) for c in contexts]

        def done(_: int, got: list[int]) -> bool:
            text = self.tokenizer.decode(got)
            return any(term and term in text for term in until)

        got = self.generator.greedy(ids, new, {self.eot_token_id}, done)
        return [
            postprocess_generated_text(self.tokenizer.decode(g, skip_special_tokens=True), until, None)
            for g in got
        ]


@functools.cache
def task_manager(paths: tuple[str, ...], names: tuple[str, ...]) -> TaskManager:
    """lm-eval's index of its tasks and those under `paths`; of `paths` alone when they define every
    one of `names` (indexing lm-eval's own thousands takes seconds)."""
    if paths:
        own = TaskManager(include_path=list(paths), include_defaults=False)
        if all(name in own.all_tasks for name in names):
            return own
    return TaskManager(include_path=list(paths) or None)


def check_tasks(names: list[str], paths: list[Path], where: str) -> None:
    """UserError unless lm-eval knows every task (its own or under `paths`)."""
    for i, path in enumerate(paths):
        if not path.exists():
            raise UserError(f"$.eval.task_paths[{i}]: {path}: no such file or directory", where)
    known = task_manager(tuple(map(str, paths)), tuple(names)).all_tasks
    for i, name in enumerate(names):
        if name not in known:
            raise UserError(
                f"$.eval.tasks[{i}]: lm-eval knows no task {name!r} (nor do $.eval.task_paths)", where
            )


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Python's, numpy's and torch's random states as they were after the block: lm-eval seeds them
    all, and a run's batches and dropout must not depend on when it evaluated."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def run_tasks(
    lm: MegaLM, names: list[str], paths: list[Path], limit: int | None
) -> list[tuple[str, str, float]]:
    """(task, metric, value) of every score lm-eval gives on `names` (a collective: every rank runs
    it; the scores come back where lm-eval reports, local rank 0, else none). A metric keeps its
    filter unless it is lm-eval's `none`; no standard errors (`bootstrap_iters=0`: a bootstrap
    costs seconds a metric), nor lm-eval's other numbers (`sample_len`)."""
    manager = task_manager(tuple(map(str, paths)), tuple(names))
    _quiet_git()
    with kept_rng():
        results = simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager, bootstrap_iters=0)
    scores = []
    for task, metrics in sorted(((results or {}).get("results") or {}).items()):
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")  # a score is `metric,filter`
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and filtered and not metric.endswith("_stderr"):
                scores.append((task, key.removesuffix(",none"), float(value)))
    return scores


def _git_hash() -> str | None:
    """lm-eval's `get_git_commit_hash` (the working directory's commit, for its results) with git's
    complaint outside a repository kept off our stderr."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())
    return done.stdout.strip()


def _quiet_git() -> None:
    """Where the console is quiet, lm-eval's results get the working directory's commit without git
    printing `fatal: not a git repository` (lm-eval lets git's stderr through)."""
    if quieted():
        lm_eval.evaluator.get_git_commit_hash = _git_hash


def main() -> None:
    """lm-eval's command line with the `mega` model registered (run as `__main__`, which took out
    `--debug` and quieted the libraries unless asked for it)."""
    from lm_eval.__main__ import cli_evaluate

    model_registry.register("mega", target="mega_train.harness:MegaLM")
    sys.argv[0] = "lm-eval"
    _quiet_git()
    try:
        cli_evaluate()
    except UserError as e:  # bad model arguments: one line, as the tools say them
        if DEBUG:
            traceback.print_exception(e)
        print(f"lm-eval (mega): error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    shutdown()  # the mega model's process group, where one was made


if __name__ == "__main__":
    main()
