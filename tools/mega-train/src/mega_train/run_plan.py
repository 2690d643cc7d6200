"""Resolve a run manifest into a plan: decode it strictly, open every artifact it references, and
check everything the training loop relies on, without torch (so without torch.distributed).

This is everything mega-train does before it touches a process group, so a bad run.json fails in
seconds with one line instead of after a torchrun launch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from mega_train.evaluation import load_metric
from mega_train.lora_plan import LoraPlan, plan_lora
from mega_train.objectives import check_data, kind_of
from mega_train.objectives.reference_plan import Reference, plan_reference
from mega_train.objectives.teacher_plan import Teacher, plan_teacher
from megacore.artifacts import CheckpointManifest, RunManifest, TokensManifest, open_artifact, resolve_ref
from megacore.artifacts.codec import decode_manifest
from megacore.artifacts.manifest import DISTILL_FIELDS, License, TrainedTokenizer
from megacore.artifacts.output import check_inputs
from megacore.artifacts.reader import Verify, check_model_tensors, read_manifest_bytes
from megacore.artifacts.writer import sha256_bytes
from megacore.config import (
    CONTEXT_FIELDS,
    DEFAULT_PAD_MULTIPLE,
    INIT_OVERRIDES,
    ROUTER_LOSS_FIELDS,
    LoRA,
    ModelConfig,
    RopeScaling,
    flops_per_token,
    parameter_counts,
    with_context,
)
from megacore.data.indexed import IndexedReader
from megacore.errors import UserError
from megacore.parallel.layout import Dims, Parallelism, check_parallelism, check_sharding, check_tp
from megacore.tokenizer_files import first_difference, recorded_vocabulary


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
        return f"$.model.{name}" if name in INIT_OVERRIDES else f"$.model.init (its config's {name})"

    @property
    def packs_pairs(self) -> bool:
        return packs_pairs(self.run)

    @property
    def rows_per_sample(self) -> int:
        """Sequences per sample of the batch: a preference objective's samples are pairs, two rows
        each (the batch sizes count pairs; memory and data count rows), unless packed (rows)."""
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


def _check_tokens(
    i: int, path: Path, tokens: TokensManifest, config: ModelConfig, run: RunManifest, where: str
) -> None:
    at = f"$.data.sources[{i}]"
    vocab = tokens.tokenizer.vocab_size
    if vocab > config.vocab_size:
        added = len(tokens.tokenizer.added_special_tokens)
        extra = f" ({added} of them added special tokens)" if added else ""
        raise UserError(
            f"{at}: {path} has token ids up to {vocab - 1}{extra}, beyond the model's vocab_size "
            f"{config.vocab_size}: resize the model's vocab (embeddings) first",
            where,
        )
    labelled = (
        tokens.format == "chat" and tokens.shards[0].sidecars.get("roles") and "assistant" in tokens.roles
    )
    if run.data.loss_on == "assistant" and not labelled:
        raise UserError(
            f"{at}: loss_on assistant needs a chat tokens artifact with an assistant role "
            "(mega-tokenize --format chat)",
            where,
        )
    check_data(at, path, tokens, run, where)
    if tokens.counts.documents < 1:
        raise UserError(f"{at}: {path} holds no documents", where)
    for shard in tokens.shards:  # the index of every shard is readable and matches its data file
        IndexedReader(path / shard.prefix)


def _check_init_tokenizer(
    init: tuple[Path, CheckpointManifest] | None,
    sources: list[tuple[Path, TokensManifest, float]],
    where: str,
) -> None:
    """The data's ids mean the tokens the init checkpoint's weights learned: its tokenizer maps every
    id both have as the data's does (compared as vocabularies, not files; the sources share one
    tokenizer). A checkpoint that records no tokenizer is not checked."""
    if init is None or (theirs := recorded_vocabulary(*init)) is None:
        return
    path, tokens, _ = sources[0]
    ours = recorded_vocabulary(path, tokens)
    diff = first_difference(theirs, ours) if ours is not None else None
    if diff is not None:
        i, there, here = diff
        raise UserError(
            f"$.data.sources[0]: {path} was tokenized with another tokenizer than the init checkpoint "
            f"{init[0]}: id {i} is {there!r} there and {here!r} here",
            where,
        )


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
    init = _open_init(base, run, verify, where)
    config, notes = _model_config(run, init, base, where)
    sources = _open_sources(base, run, config, verify, where)
    _check_init_tokenizer(init, sources, where)
    _check_schedule(run, config, init is not None, where)
    lora = plan_lora(run, init, base, verify, where)
    reference = plan_reference(run, init, lora, base, verify, where)
    teacher = plan_teacher(run, config, sources, base, verify, where)
    dims, microbatches, stages = _check_layout(run, config, world_size, where)
    check_sharding(
        config,
        parallelism(run, microbatches, lora=None if lora is None else lora.lora),
        dims,
        f"{where}: $.parallel",
    )
    # The user's metric modules are imported now, so a wrong path fails here and not at the first eval.
    metrics = [load_metric(p, f"$.eval.metrics[{i}]", where) for i, p in enumerate(run.eval.metrics)]
    task_paths = _check_generation(run, sources, base, where)
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
        + ([teacher.describe(run)] if teacher is not None else []),
        lora=lora,
        reference=reference,
        teacher=teacher,
    )
    check_inputs(out, plan.inputs, "$.out")
    check_inputs(checkpoints, plan.inputs, "$.checkpoint.dir")
    check_run_dir(out, "$.out")
    return plan


def _open_init(
    base: Path, run: RunManifest, verify: Verify, where: str
) -> tuple[Path, CheckpointManifest] | None:
    """`$.model.init`, opened and checked against its config, when given (or `config`, or
    `hf_config`: exactly one of the three)."""
    m = run.model
    given = [name for name in ("init", "config", "hf_config") if getattr(m, name) is not None]
    if len(given) != 1:
        extra = f"$.model.{given[1]}" if len(given) > 1 else "$.model"
        beside = "; beside `init` only max_seq_len, rope_scaling and the router loss coefficients can be set"
        raise UserError(
            "give exactly one of `init` (a checkpoint), `config` or `hf_config` (a Hugging Face "
            f"config.json){beside if 'init' in given else ''}",
            f"{where}: {extra}",
        )
    if m.init is None and run.objective.type == "dpo":
        raise UserError(
            "$.model.init: dpo's reference is the model the run starts from: give it as `init` (a "
            "checkpoint); simpo and orpo need none",
            where,
        )
    if m.init is None:
        return None
    path = resolve_ref(base, m.init)
    init = (path, open_artifact(path, "checkpoint", verify=verify))
    check_model_tensors(init[1], f"{where}: $.model.init: {path}")
    return init


def _model_config(
    run: RunManifest, init: tuple[Path, CheckpointManifest] | None, base: Path, where: str
) -> tuple[ModelConfig, list[str]]:
    """The model the run trains (the config its checkpoints record) and a note when it is not the
    init's: `config`, a Hugging Face config.json's (`hf_config`), or the init's with the context
    `max_seq_len` and `rope_scaling` set and the router losses' coefficients."""
    m = run.model
    if init is None:
        for name in INIT_OVERRIDES:
            if getattr(m, name) is not None:
                raise UserError(
                    f"$.model.{name}: a run from `config` or `hf_config` sets it in the model's config "
                    "(beside `init` it sets it for a run from a checkpoint)",
                    where,
                )
        if m.config is not None:
            return m.config, []
        return read_hf_config(resolve_ref(base, m.hf_config), where)
    before = init[1].config
    routers = {f: getattr(m, f) for f in ROUTER_LOSS_FIELDS if getattr(m, f) is not None}
    try:
        config = msgspec.structs.replace(with_context(before, m.max_seq_len, m.rope_scaling), **routers)
    except ValueError as e:  # llama3 / yarn without the original context, router losses of a dense model
        raise UserError(f"$.model: {e}", where) from None
    if all(getattr(config, f) == getattr(before, f) for f in CONTEXT_FIELDS):
        return config, []
    note = (
        f"the model's context: {config.max_seq_len:,} positions (the init's {before.max_seq_len:,}), "
        f"RoPE {_describe_rope(config.rope_scaling)}; the run's checkpoints record this config"
    )
    return config, [note]


def read_hf_config(path: Path, where: str) -> tuple[ModelConfig, list[str]]:
    """The model a Hugging Face config.json describes (`path`: the file, or a model directory
    holding one), its vocab padded as mega-convert pads it, and the note that says so; torch-free
    (`megacore.models.families`): a dry run plans a model whose weights are not here."""
    from megacore.models import config_from_hf
    from megacore.models.families.hf_config import read_config_json

    at = f"{where}: $.model.hf_config"
    data = read_config_json(path, at)
    file = path / "config.json" if path.is_dir() else path
    config = config_from_hf(data, f"{at}: {file}", pad_multiple=DEFAULT_PAD_MULTIPLE)
    note = (
        f"the model of {file} ({config.family}), from fresh weights: its weights are not read (to "
        "fine-tune them, convert the model with mega-convert and give it as `init`)"
    )
    return config, [note]


def _describe_rope(scaling: RopeScaling | None) -> str:
    if scaling is None:
        return "unscaled"
    original = scaling.original_max_position_embeddings
    return f"{scaling.type} x{scaling.factor:g}" + (f" of {original:,}" if original else "")


def _open_sources(
    base: Path, run: RunManifest, config: ModelConfig, verify: Verify, where: str
) -> list[tuple[Path, TokensManifest, float]]:
    """The data sources, each opened and checked; they share one tokenizer (and assistant code)."""
    sources = []
    for i, src in enumerate(run.data.sources):
        path = resolve_ref(base, src.path)
        tokens = open_artifact(path, "tokens", verify=verify)
        _check_tokens(i, path, tokens, config, run, where)
        sources.append((path, tokens, src.weight))
    first = sources[0][1].tokenizer
    for i, (path, tokens, _) in enumerate(sources[1:], 1):
        theirs = tokens.tokenizer
        if (theirs.fingerprint, theirs.added_special_tokens) != (
            first.fingerprint,
            first.added_special_tokens,
        ):
            raise UserError(
                f"$.data.sources[{i}]: {path} was tokenized with another tokenizer than $.data.sources[0] "
                f"(fingerprint {theirs.fingerprint[:12]}, added {theirs.added_special_tokens} against "
                f"{first.fingerprint[:12]}, {first.added_special_tokens}): the same id would mean different text",
                where,
            )
    if run.data.loss_on == "assistant" and len({m.roles["assistant"] for _, m, _ in sources}) > 1:
        codes = ", ".join(f"{m.roles['assistant']} in {p}" for p, m, _ in sources)
        raise UserError(f"$.data.sources: the assistant role has different codes ({codes})", where)
    return sources


def _check_schedule(run: RunManifest, config: ModelConfig, from_init: bool, where: str) -> None:
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
    if run.attention == "flash" and config.attn_sinks:
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


def _check_generation(
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


def _check_layout(
    run: RunManifest, config: ModelConfig, world_size: int, where: str
) -> tuple[Dims, int, list]:
    """The mesh's sizes, the microbatches of a step and each stage's layers, for this world size."""
    b, par = run.batch, run.parallel
    check_tp(config, par.tp, f"{where}: $.parallel.tp")  # before the world: the more basic mistake
    dims = Dims.for_world(world_size, par.tp, par.pp, par.cp, par.ep, f"{where}: $.parallel")
    dims.check_seq_length(b.seq_length, par.sequence_parallel, f"{where}: $.parallel.cp")
    # One step runs the rank's share of the batch as microbatches of `micro_batch_size`.
    microbatches = dims.microbatches(
        b.global_batch_size, b.micro_batch_size, f"{where}: $.batch.global_batch_size"
    )
    stages = check_parallelism(config, parallelism(run, microbatches), f"{where}: $.parallel")
    return dims, microbatches, stages


def parallelism(
    run: RunManifest, microbatches: int, fp8_emulate: bool = False, lora: LoRA | None = None
) -> Parallelism:
    """The engine's layout settings of a run whose step has `microbatches` microbatches per rank."""
    return Parallelism(
        run.parallel,
        run.precision,
        microbatches,
        run.compile is True,
        run.recompute,
        run.fp8_scaling,
        run.attention,
        fp8_emulate,
        lora,
        packs_pairs(run),
    )


def packs_pairs(run: RunManifest) -> bool:
    """Whether a preference run packs whole pairs into each row (`"packing": "pack"`)."""
    return kind_of(run).pairs and run.data.packing == "pack"


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


def fingerprint(
    run: RunManifest,
    init: tuple[Path, CheckpointManifest] | None,
    sources: list[tuple[Path, TokensManifest, float]],
    lora: LoraPlan | None = None,
    reference: Reference | None = None,
    teacher: Teacher | None = None,
) -> dict[str, str]:
    """What decides the model's start, the sequence of batches and the updates, by manifest field: a
    run resumes only from a checkpoint with the same values. The layout, the precision and
    train_steps may change (the schedule is stretched: `schedule.py`)."""
    out = {
        "$.data.split": json.dumps(run.data.split),
        "$.data.loss_on": run.data.loss_on,
        "$.data.packing": run.data.packing or ("pad" if kind_of(run).pairs else "pack"),
        "$.data.doc_mask": str(run.data.doc_mask),
        "$.seed": str(run.seed),
        "$.batch.seq_length": str(run.batch.seq_length),
        "$.batch.global_batch_size": str(run.batch.global_batch_size),
        "$.model.init": sha256_bytes(read_manifest_bytes(init[0])[1]) if init else "none",
        "$.data.sources": str(len(sources)),
    }
    if lora is not None:  # the adapters' shape and start; their base is $.model.init's
        out["$.lora"] = json.dumps(dataclasses.asdict(lora.lora))
        if lora.init is not None:
            out["$.lora.init"] = sha256_bytes(read_manifest_bytes(lora.init[0])[1])
    if run.objective.type != "lm":  # language modelling's runs keep their fingerprints
        out |= _objective_fingerprint(run, reference, teacher)
    for name, value in msgspec.structs.asdict(run.optimizer).items():
        out[f"$.optimizer.{name}"] = json.dumps(value)
    for i, (path, _, weight) in enumerate(sources):
        out[f"$.data.sources[{i}]"] = f"{sha256_bytes(read_manifest_bytes(path)[1])} weight {weight}"
    return out


def _objective_fingerprint(
    run: RunManifest, reference: Reference | None, teacher: Teacher | None
) -> dict[str, str]:
    """The objective's settings: a preference objective's as runs saved them before
    `reference_logps` (its value under "reference") and before distillation's settings, and the
    reference model apart, so that their checkpoints still resume; distillation's and its teacher."""
    spec = msgspec.structs.asdict(run.objective)
    if teacher is not None:
        out = {"$.objective": json.dumps({k: spec[k] for k in ("type", *DISTILL_FIELDS)}, sort_keys=True)}
        return out | {"$.objective.teacher": teacher.manifest_sha256}
    for name in DISTILL_FIELDS:
        del spec[name]
    spec["reference"] = spec.pop("reference_logps")
    out = {"$.objective": json.dumps(spec, sort_keys=True)}
    if reference is not None:
        out["$.objective.reference"] = f"{reference.kind} {reference.manifest_sha256 or ''}".strip()
    return out
