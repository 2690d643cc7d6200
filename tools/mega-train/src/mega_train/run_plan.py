"""Resolve a run manifest into a plan: decode it strictly, open every artifact it references, and
check everything the training loop relies on, without torch (so without torch.distributed).

This is everything mega-train does before it touches a process group, so a bad run.json fails in
seconds with one line instead of after a torchrun launch. `plan_run` is the order of it, and
`RunPlan` the checked run; the parts are modules of their own, each torch-free too: the artifacts
(`run_artifacts.py`: the model, the data and their tokenizer), the settings' checks
(`run_checks.py`), the layout (`run_layout.py`) and the fingerprint a resume must match
(`run_fingerprint.py`). `start_checks` adds what needs this machine, `check_run_dir` what `out` may be.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mega_train.evaluation import load_metric
from mega_train.lora_plan import LoraPlan, plan_lora
from mega_train.objectives import kind_of
from mega_train.objectives.grpo_plan import check_objective
from mega_train.objectives.grpo_plan import describe as describe_rollouts
from mega_train.objectives.reference_plan import Reference, plan_reference
from mega_train.objectives.teacher_plan import Teacher, plan_teacher
from mega_train.run_artifacts import (
    check_init_tokenizer,
    model_config,
    open_init,
    open_sources,
    read_hf_config,
)
from mega_train.run_checks import check_generation, check_schedule, has_valid_split
from mega_train.run_fingerprint import fingerprint
from mega_train.run_layout import check_layout, packs_pairs, parallelism
from megacore.artifacts import CheckpointManifest, RunManifest, TokensManifest, resolve_ref
from megacore.artifacts.codec import decode_manifest
from megacore.artifacts.manifest import License, TrainedTokenizer
from megacore.artifacts.output import check_inputs
from megacore.artifacts.reader import Verify, read_manifest_bytes
from megacore.config import CONTEXT_FIELDS, ModelConfig, under
from megacore.errors import UserError
from megacore.parallel.layout import Dims, Parallelism, check_sharding
from megacore.planner.counts import flops_per_token, parameter_counts

# What callers import from here; some of it lives in the modules above.
__all__ = [
    "COMPILE_PAYS_S",
    "CPU_TFLOPS",
    "RUN_MARK",
    "RunPlan",
    "check_run_dir",
    "fingerprint",
    "has_valid_split",
    "packs_pairs",
    "parallelism",
    "plan_run",
    "read_hf_config",
    "start_checks",
]


@dataclass
class RunPlan:
    """A checked run: the manifest, its resolved artifacts and the layout for a world size."""

    path: Path
    run: RunManifest
    config: ModelConfig
    init: tuple[Path, CheckpointManifest] | None
    data: list[tuple[Path, TokensManifest, float]]
    dims: Dims  # the mesh's sizes for this world
    grad_accum: int
    stage_layers: list[list[int]]
    out: Path  # the run directory
    checkpoints: Path  # where step-NNNNNNNN checkpoints and `latest` go
    fingerprint: dict[str, str]  # what a resumed run must share with the saved one, by field
    eval_metrics: list[Callable] = field(default_factory=list)  # $.eval.metrics, imported
    task_paths: list[Path] = field(default_factory=list)  # $.eval.task_paths, resolved
    notes: list[str] = field(default_factory=list)  # said once by rank 0, in a run and a dry run alike
    lora: LoraPlan | None = None  # adapters on a frozen base (`lora_plan`)
    reference: Reference | None = None  # dpo's reference model (`objectives.reference_plan`)
    teacher: Teacher | None = None  # distillation's teacher (`objectives.teacher_plan`)
    fp8_emulate: bool = False  # precision fp8 emulated (`fp8.float8_emulation`, decided by `start_checks`)

    def resume_notes(self, verify: Verify = "size") -> tuple[list[str], int]:
        """Where a run would start (a dry run's report, and the step: 0 for a fresh start; the run
        itself says it as it resumes), with the same search as the run's
        (`checkpoints.resume_point`) and the same refusal of a checkpoint it may not resume from
        (`check_resume`)."""
        from mega_train.checkpoints import resume_point
        from mega_train.lifecycle import LOCK_FILE, describe, held_by

        notes = []
        holder = held_by(self.out / LOCK_FILE)
        if holder is not None:
            notes.append(f"{self.out} is in use by {describe(holder)}: a run started now would be refused")
        found, damaged = resume_point(self.checkpoints, verify)
        for path, why in damaged:
            notes.append(f"warning: {path} is damaged ({why}); the run will set it aside")
        if found is None:
            return notes, 0
        self.check_resume(*found)
        step = found[1].training.step
        notes.append(f"resumes from {found[0]} (step {step} of {self.run.train_steps})")
        return notes, step

    def check_resume(self, path: Path, manifest: CheckpointManifest) -> None:
        """UserError unless this run may resume from the checkpoint `path`: the same model (the
        context included) and the same fingerprint. The launch and the dry run both ask here."""
        from mega_train.checkpoints import check_resumable

        check_resumable(path, manifest, self.config, self.fingerprint, str(self.path), self.config_field)

    def config_field(self, name: str) -> str:
        """Where the run manifest sets the model config's field `name`: in `config` (or the
        config.json of `hf_config`), or for a run from a checkpoint, the context fields beside
        `init` and the others in the init itself."""
        if self.init is None and self.run.model.hf_config is not None:
            return f"$.model.hf_config (its config.json's {name})"
        if self.init is None:
            return f"$.model.config.{name}"
        context = under(name, CONTEXT_FIELDS)
        return f"$.model.{CONTEXT_FIELDS[context]}" if context else f"$.model.init (its config's {name})"

    @property
    def packs_pairs(self) -> bool:
        return packs_pairs(self.run)

    @property
    def rows_per_sample(self) -> int:
        """Sequences per sample of the batch: a preference objective's samples are pairs, two rows
        each (the batch sizes count pairs; memory and data count rows), unless packed (rows); an
        online RL objective's are prompts, a row for each of their completions."""
        if kind_of(self.run).prompts:
            return self.run.objective.num_generations
        return 2 if kind_of(self.run).pairs and not self.packs_pairs else 1

    @property
    def sample_unit(self) -> str:
        """What the batch sizes count: the objective's samples (sequences, pairs), or rows of
        packed pairs."""
        return "rows of packed pairs" if self.packs_pairs else kind_of(self.run).counts

    @property
    def tokenizer(self) -> tuple[Path, TrainedTokenizer]:
        """The data's tokenizer (every source shares it) and the directory its files are in: what
        each checkpoint records as the tokenizer its weights were trained with."""
        path, tokens, _ = self.data[0]
        return path, TrainedTokenizer(tokens.tokenizer, tokens.chat_template, tokens.prepend_bos)

    @property
    def license(self) -> License | None:
        """The init checkpoint's license (its source model's), which every checkpoint carries on."""
        return self.init[1].license if self.init is not None else None

    @property
    def world_size(self) -> int:
        return self.dims.world

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def parallelism(self) -> Parallelism:
        """What the engine builds for this run (every rank alike); "compile": "auto" is decided on
        the machine that trains (`compiles`)."""
        lora = self.lora.lora if self.lora is not None else None
        return parallelism(self.run, self.grad_accum, self.fp8_emulate, lora)

    def compiles(self, gpu: bool) -> bool:
        """Whether the blocks are compiled: `compile` when it is true or false; "auto" (the
        default) compiles on a GPU (bench/bench_gpu.py: 1.36x the eager step of a 1.1B Llama on an
        H200), and on a CPU when the run's compute is long enough to repay the compile: measured on
        2 cores, compiling a 125M Llama's blocks costs about 15 s on the first step and saves 7%
        (fp32) to 15% (bf16) of every later step, so it pays after about 3.5 minutes of steps;
        COMPILE_PAYS_S (10 minutes) of estimated compute (`cpu_run_seconds`) leaves a margin. A
        CPU also needs a C++ compiler, which Inductor's code for it is built with. QLoRA runs eager."""
        if self.run.compile != "auto":
            return self.run.compile
        if self.lora is not None and self.lora.lora.base_dtype == "nf4":
            return False  # QLoRA runs eager (`layout.check_nf4`)
        if kind_of(self.run).prompts:
            return False  # the sampler runs eager (`objectives/grpo_plan.py`)
        if gpu:
            return True
        return self.cpu_run_seconds() >= COMPILE_PAYS_S and any(map(shutil.which, ("c++", "g++", "clang++")))

    def compile_note(self, this_machine: bool = True) -> str | None:
        """What "compile": "auto" will do, for the dry run (which needs no torch to know the GPU).
        `this_machine`: false for a dry run planning GPUs elsewhere (--gpus), which compile."""
        if self.run.compile != "auto":
            return None
        if not this_machine:
            return "compile auto: compiles the blocks on the GPUs"
        minutes = self.cpu_run_seconds() / 60
        cpu = "compiles" if self.compiles(gpu=False) else "runs eager"
        return (
            f"compile auto: compiles the blocks on a GPU; on a CPU it {cpu} (about {minutes:.3g} "
            f"minutes of compute estimated, compiling pays from {COMPILE_PAYS_S // 60})"
        )

    def cpu_run_seconds(self) -> float:
        """The run's compute on one rank at CPU_TFLOPS: train steps x the step's FLOPs (`flops_per_token`
        x the global batch's tokens) over the world."""
        b = self.run.batch
        step = flops_per_token(self.config, b.seq_length) * b.global_batch_size * b.seq_length
        return self.run.train_steps * step / self.world_size / (CPU_TFLOPS * 1e12)

    @property
    def inputs(self) -> list[Path]:
        """The artifacts this run reads: never written over, nor into."""
        adapter = [self.lora.init[0]] if self.lora is not None and self.lora.init is not None else []
        ref = self.reference
        adapter += [ref.path] if ref is not None and ref.path is not None and ref.path not in adapter else []
        adapter += [self.teacher.path] if self.teacher is not None else []
        return ([self.init[0]] if self.init else []) + adapter + [path for path, _, _ in self.data]

    def summary(self) -> dict:
        """The plan as JSON-able data; every path is resolved the same way (against the manifest's
        directory) and printed as a usable path."""
        parameters, active = parameter_counts(self.config)
        return {
            "manifest": str(self.path),
            "model": {
                "family": self.config.family,
                "layers": self.config.num_layers,
                "hidden": self.config.hidden_size,
                "max_seq_len": self.config.max_seq_len,
                "parameters": parameters,
                "active_parameters": active,
                "trained_parameters": self.lora.trained_parameters(self.config) if self.lora else parameters,
            },
            "lora": None if self.lora is None else self.lora.summary(),
            "init": str(self.init[0]) if self.init is not None else None,
            "out": str(self.out),
            "checkpoints": str(self.checkpoints),
            "data": [{"path": str(d), "tokens": m.counts.tokens, "weight": w} for d, m, w in self.data],
            "parallel": {"world_size": self.world_size, **dataclasses.asdict(self.dims)},
            "stage_layers": self.stage_layers,
            "objective": self.run.objective.type,
            "sample_unit": self.sample_unit,
            "batch": {
                "rows_per_sample": self.rows_per_sample,
                "micro": self.run.batch.micro_batch_size,
                "global": self.run.batch.global_batch_size,
                "grad_accum": self.grad_accum,
                "seq_length": self.run.batch.seq_length,
            },
            "train_steps": self.run.train_steps,
        }


def plan_run(manifest_path: Path, world_size: int, verify: Verify = "size") -> RunPlan:
    """Load and check `run.json` for a job of `world_size` processes."""
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        raise UserError("no such run manifest", str(manifest_path))
    base, data = read_manifest_bytes(manifest_path)
    run = decode_manifest(data, str(manifest_path), kind="run")
    assert isinstance(run, RunManifest)
    where = str(manifest_path)
    if world_size < 1:
        raise UserError(f"must be at least 1, got {world_size}", "--world-size")
    init = open_init(base, run, verify, where)
    config, notes = model_config(run, init, base, where)
    sources = open_sources(base, run, config, verify, where)
    check_init_tokenizer(init, sources, where)
    check_schedule(run, config, init is not None, where)
    lora = plan_lora(run, init, base, verify, where)
    reference = plan_reference(run, init, lora, base, verify, where)
    teacher = plan_teacher(run, config, sources, base, verify, where)
    rewards = check_objective(run, init is not None, lora is not None, base, where)
    dims, microbatches, stages = check_layout(run, config, world_size, where)
    check_sharding(
        config,
        parallelism(run, microbatches, lora=None if lora is None else lora.lora),
        dims,
        f"{where}: $.parallel",
    )
    # The user's metric modules are imported now, so a wrong path fails here and not at the first eval.
    metrics = [load_metric(p, f"$.eval.metrics[{i}]", where) for i, p in enumerate(run.eval.metrics)]
    task_paths = check_generation(run, sources, base, where)
    out = resolve_ref(base, run.out)
    checkpoints = resolve_ref(base, run.checkpoint.dir) if run.checkpoint.dir else out / "checkpoints"
    plan = RunPlan(
        path=manifest_path,
        run=run,
        config=config,
        init=init,
        data=sources,
        dims=dims,
        grad_accum=microbatches,
        stage_layers=stages,
        out=out,
        checkpoints=checkpoints,
        fingerprint=fingerprint(run, init, sources, lora, reference, teacher),
        eval_metrics=metrics,
        task_paths=task_paths,
        notes=notes
        + ([reference.describe()] if reference is not None else [])
        + ([teacher.describe(run)] if teacher is not None else [])
        + ([describe_rollouts(run, rewards)] if rewards else []),
        lora=lora,
        reference=reference,
        teacher=teacher,
    )
    check_inputs(out, plan.inputs, "$.out")
    check_inputs(checkpoints, plan.inputs, "$.checkpoint.dir")
    check_run_dir(out, "$.out")
    return plan


# "compile": "auto" on a CPU (`RunPlan.compiles`): what a bf16 step of a 125M Llama achieves on 2
# cores (bench_train: about 550 tokens/s at 0.66 GFLOP a token), and the estimated compute from
# which compiling pays with a margin.
CPU_TFLOPS = 0.36
COMPILE_PAYS_S = 600

RUN_MARK = ".mega-train"  # in a run directory this tool made: a rerun resumes there


def start_checks(plan: RunPlan, machine: bool = True) -> None:
    """What a run checks before it starts, beyond the manifest and its artifacts: the same for a
    dry run and a run. `machine`: this machine is the one that trains (not a dry run planning
    other GPUs with --gpus)."""
    if machine and plan.run.attention == "flash":
        import torch

        if not torch.cuda.is_available():
            raise UserError(
                "$.attention: 'flash' runs on a GPU and this machine has none; use auto or sdpa",
                str(plan.path),
            )
    if machine and plan.run.precision == "fp8":
        from megacore.parallel.fp8 import float8_emulation

        plan.fp8_emulate = float8_emulation(str(plan.path))
    split = plan.run.data.split
    if abs(sum(split) - 1) > 1e-6:
        used = [round(f / sum(split), 4) for f in split]
        plan.notes.append(f"$.data.split {split} sums to {sum(split):g}: the fractions used are {used}")


def check_run_dir(out: Path, where: str) -> None:
    """`out` is absent, an empty directory, or a run directory mega-train made (a rerun resumes)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{out} exists and is not a directory", where)
    if any(out.iterdir()) and not (out / RUN_MARK).is_file():
        raise UserError(
            f"{out} exists and is not a mega-train run directory (no {RUN_MARK}); it is not written "
            "into: choose another path",
            where,
        )
