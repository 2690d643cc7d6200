"""Every environment variable the tools read or set, in one table, and the one place that touches
them (beside the tools' `cli.py`, which parse what a command line is given): a setting reaching deep
code from outside its arguments is read here, so it is found, documented and tested.

docs/architecture.md ("Environment variables") shows this table; tests/tools/test_environment.py
keeps the two the same and finds no other module reading `os.environ`. Variables that only the
libraries underneath read (HF_TOKEN, WANDB_*, NCCL_*, ...) are theirs, documented there, not read
here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    used_by: str
    meaning: str


VARIABLES = (
    Variable(
        "MEGA_DEBUG", "every tool", "1: as `--debug`: the traceback of an error, and the libraries' warnings"
    ),
    Variable(
        "MEGA_FP8_EMULATE",
        "mega-train",
        "1: `precision: fp8` runs torchao's float8 emulation where no GPU has float8 matmuls (tests only)",
    ),
    Variable(
        "MEGA_TRAIN_INJECT",
        "mega-train",
        "faults for tests, `nan-grad@3,kill@7`: nan-grad, nan-loss, kill, kill-in-save, stall-in-save at a step",
    ),
    Variable(
        "MEGA_TRAIN_MALLOC",
        "mega-train",
        "`default`: keep glibc's allocator settings on a CPU run (no heap mode, nor a LoRA run's trim before each microbatch once its heap fragments)",
    ),
    Variable("RANK", "mega-train", "torchrun's: this worker's rank (absent: a job of one process)"),
    Variable("WORLD_SIZE", "mega-train", "torchrun's: the job's processes"),
    Variable("LOCAL_RANK", "mega-train", "torchrun's: this worker's GPU on its node"),
    Variable(
        "TORCHELASTIC_RUN_ID", "mega-train", "torchrun's: a worker watches its launcher and stops with it"
    ),
    Variable(
        "TORCHELASTIC_RESTART_COUNT",
        "mega-train",
        "torchrun's: the workers' restart; each start's process groups keep their keys apart in the store",
    ),
    Variable("SLURM_JOB_ID", "mega-train", "a requeued SLURM job takes over its own run's lock"),
    Variable(
        "XDG_CACHE_HOME", "mega-tokenize", "where converted tokenizers are cached (`~/.cache` if unset)"
    ),
    Variable(
        "RAYON_NUM_THREADS",
        "mega-tokenize (sets)",
        "the tokenizer libraries' thread pools, set from `--workers` unless already set",
    ),
    Variable("RAYON_RS_NUM_CPUS", "mega-tokenize (sets)", "as RAYON_NUM_THREADS, for gigatoken"),
    Variable("TOKENIZERS_PARALLELISM", "mega-tokenize (sets)", "set from `--workers`"),
    Variable(
        "OMP_NUM_THREADS",
        "mega-train (sets)",
        "1 for the workers of `--nproc-per-node` unless set, as torchrun",
    ),
    Variable(
        "TQDM_DISABLE",
        "every tool, the harness (sets)",
        "1 unless `--debug` or set: tqdm's progress bars (lm-eval's) off",
    ),
    Variable(
        "HF_DATASETS_DISABLE_PROGRESS_BARS",
        "every tool, the harness (sets)",
        "1 unless `--debug` or set: datasets' progress bars (lm-eval's task data) off",
    ),
    Variable(
        "LMEVAL_LOG_LEVEL",
        "every tool, the harness (sets)",
        "ERROR unless `--debug` or set: lm-eval's command line logs errors only",
    ),
)
_NAMES = {v.name for v in VARIABLES}


def get(name: str, default: str | None = None) -> str | None:
    """The value of a variable of the table (KeyError for one it does not list: list it first)."""
    if name not in _NAMES:
        raise KeyError(f"{name} is not in megacore.env.VARIABLES")
    return os.environ.get(name, default)


def flag(name: str) -> bool:
    """Whether a variable of the table is set to 1."""
    return get(name) == "1"


def set_for_libraries(name: str, value: str, override: bool = False) -> bool:
    """Set a variable of the table that a library underneath reads (unless already set, or
    `override`); whether it set it."""
    if name not in _NAMES:
        raise KeyError(f"{name} is not in megacore.env.VARIABLES")
    if override or name not in os.environ:
        os.environ[name] = value
        return True
    return False


def unset(name: str) -> None:
    """Remove a variable of the table (one set for the libraries, once they no longer need it)."""
    if name not in _NAMES:
        raise KeyError(f"{name} is not in megacore.env.VARIABLES")
    os.environ.pop(name, None)
