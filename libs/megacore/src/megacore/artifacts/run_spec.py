"""The run manifest (`kind: run`): what `mega-train --manifest run.json` trains, its sections as
structs (docs/mega-train.md#reference). Decoded strictly like every manifest
(`megacore.artifacts.codec`); checked against the artifacts it names by `mega_train.run_plan`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from megacore.artifacts.header import (
    FLOAT_DTYPES,
    Header,
    LoRATarget,
    NonNegative,
    NonNegativeFloat,
    Ref,
    precision_name,
)
from megacore.config import ModelConfig, Positive, PositiveFloat, Struct
from megacore.config_parts import RopeScaling

Schedule = Literal["gpipe", "1f1b", "interleaved1f1b", "zbv", "interleavedzb"]


class ModelSpec(Struct):
    """Start from a checkpoint artifact (`init`), or from scratch with a `config`, or with the
    model a Hugging Face `config.json` describes (`hf_config`: the file, or a model directory
    holding one; the weights are not read, so a dry run plans a model not downloaded). Beside `init`,
    `max_seq_len` and `rope_scaling` set the context the run trains for (context extension: a
    longer max_seq_len with a RoPE scaling), every other field of the model staying the init's; the
    run's checkpoints record the config that results (`megacore.config.with_context`). Whatever the
    start, a mixture of experts' training settings are the run's: the router losses' weights and
    the balancing bias's step (`megacore.config.RouterLosses`; 0: off)."""

    init: Ref | None = None
    config: ModelConfig | None = None
    hf_config: Ref | None = None
    max_seq_len: Positive | None = None  # None: the init's
    rope_scaling: RopeScaling | None = None  # None: the init's
    # A mixture of experts' router losses' weights in the training loss (0: off).
    router_aux_loss_coef: NonNegativeFloat = 0.0
    router_z_loss_coef: NonNegativeFloat = 0.0
    # DeepSeek V3's auxiliary-loss-free balancing: the router bias's step after each step (0: off).
    router_bias_update: NonNegativeFloat = 0.0
    init_std: PositiveFloat = 0.02  # of fresh weights (with `config`), drawn per tensor from the seed


class LoRASpec(Struct):
    """Train low-rank adapters on a frozen base (`megacore.models.adapters`), PEFT's LoRA: `targets`
    by their Hugging Face module names (PEFT's `target_modules`), `rank` None: PEFT's 8, `alpha`
    None: the rank (a scale of 1); `rslora`: scale alpha / sqrt(rank). `init`: an adapter checkpoint to continue from (its
    rank, alpha and targets then hold). `base_dtype` "nf4": the frozen base stored in 4 bits
    (QLoRA)."""

    rank: Positive | None = None
    alpha: PositiveFloat | None = None
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    targets: list[LoRATarget] | None = None
    rslora: bool = False
    init: Ref | None = None
    base_dtype: Literal["nf4"] | None = None


class DataSource(Struct):
    path: Ref
    weight: PositiveFloat = 1.0


class DataSpec(Struct):
    sources: Annotated[list[DataSource], msgspec.Meta(min_length=1)]
    # train/valid[/test] fractions of the documents
    split: Annotated[list[NonNegativeFloat], msgspec.Meta(min_length=1, max_length=3)] = msgspec.field(
        default_factory=lambda: [0.98, 0.02]
    )
    loss_on: Literal["all", "assistant"] = "all"
    # Chat sources: several whole conversations per sample ("pack", their default) or one ("pad");
    # preference sources: one side per row ("pad", their default) or whole pairs packed ("pack":
    # the batch then counts rows). Each attends only to itself. Text sources are cut into samples
    # anywhere (GPT); doc_mask keeps their documents apart too.
    packing: Literal["pack", "pad"] | None = None
    doc_mask: bool = False

    def __post_init__(self) -> None:
        if not sum(self.split) > 0:
            raise ValueError("split: the fractions must not all be zero")


class ParallelSpec(Struct):
    """tp, pp and cp are set; dp is what is left: world size / (tp * pp * cp), never set by hand;
    ep divides dp."""

    tp: Positive = 1
    pp: Positive = 1
    # Context parallel: each sequence spread over cp ranks (megacore.parallel.cp).
    cp: Positive = 1
    # Expert parallel: each MoE layer's experts split over ep of the dp ranks (megacore.parallel.ep).
    ep: Positive = 1
    pp_layers: list[Positive] | None = None
    schedule: Schedule = "1f1b"
    virtual_stages: Positive = 1
    sequence_parallel: bool = False
    dp_mode: Literal["fsdp", "replicate"] = "fsdp"


class BatchSpec(Struct):
    micro_batch_size: Positive
    global_batch_size: Positive
    seq_length: Positive


class OptimizerSpec(Struct):
    name: Literal["adamw"] = "adamw"
    lr: PositiveFloat = 3e-4
    min_lr: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.1
    betas: Annotated[
        list[Annotated[float, msgspec.Meta(ge=0, lt=1)]], msgspec.Meta(min_length=2, max_length=2)
    ] = msgspec.field(default_factory=lambda: [0.9, 0.95])
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0  # 0: no clipping
    warmup_steps: NonNegative = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # fp16's dynamic loss scale: halved on an overflow (the step is skipped), doubled after
    # `loss_scale_window` steps without one.
    initial_loss_scale: PositiveFloat = 65536.0
    loss_scale_window: Positive = 1000


class CheckpointSpec(Struct):
    """Save every `every` steps and at the end into `dir` (default: `checkpoints` in the run's
    `out`), as `step-00000012` checkpoint artifacts and a `latest` link; `keep` the last K. `async`:
    training goes on while the files are written (`mega_train.saving`); "auto" (the default) on a
    GPU, whose state the host copy does not take memory from."""

    dir: Ref | None = None
    every: Positive = 1000
    keep: Positive | None = None
    async_: bool | Literal["auto"] = msgspec.field(default="auto", name="async")


class WatchdogSpec(Struct):
    """A rank that finishes no step (nor evaluation, nor save) for `hang_s` seconds writes every
    thread's stack to `out/hangs/`, the ranks that stopped progressing are named, and the job exits
    (`mega_train.watchdog`); null: not watched."""

    hang_s: PositiveFloat | None = 1800.0


class NanSpec(Struct):
    """A step whose loss or gradients are not finite is never applied: `skip` goes on, `halt` stops
    (exit 1) once `max_steps` such steps happened in the run."""

    policy: Literal["skip", "halt"] = "skip"
    max_steps: Positive = 1


class ChatMessage(Struct):
    """One turn of a chat prompt (`SamplesSpec`): the chat template's role and text."""

    role: Annotated[str, msgspec.Meta(min_length=1)]
    content: str


class SamplesSpec(Struct):
    """Greedy completions of `prompts`, up to `max_new_tokens` each, every `every` steps and at the
    end, from the live model (mega-train's README, Samples). A prompt is text, or a conversation
    (`ChatMessage`s) rendered by the data's chat template with the assistant's turn opened; on chat
    data a text prompt is one user turn."""

    prompts: Annotated[list[str | list[ChatMessage]], msgspec.Meta(min_length=1)]
    every: Positive
    max_new_tokens: Positive = 64


class EvalSpec(Struct):
    """Every `every` steps (0: never) and at the end: loss, perplexity, next-token accuracy and the
    `metrics` (`module:function` import paths, mega-train's README) over `iters` valid batches, and
    the lm-evaluation-harness `tasks` (names lm-eval knows, or defined by the YAMLs under
    `task_paths`), `limit` documents of each when set; `samples`: greedy completions."""

    every: NonNegative = 0
    iters: Positive = 10
    metrics: list[str] = msgspec.field(default_factory=list)
    tasks: list[Annotated[str, msgspec.Meta(min_length=1)]] = msgspec.field(default_factory=list)
    task_paths: list[Ref] = msgspec.field(default_factory=list)
    limit: Positive | None = None
    samples: SamplesSpec | None = None


class LoggingSpec(Struct):
    """A console line every `every` steps; with `wandb_project` set, rank 0 also logs to W&B."""

    every: Positive = 1
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "disabled"


class RewardSpec(Struct):
    """A reward function of online RL (`mega_train.rewards`): a built-in name, "FILE.py:NAME"
    relative to this manifest, or "MODULE:NAME"; its weight in the completion's reward and the
    keyword arguments bound to it."""

    function: Annotated[str, msgspec.Meta(min_length=1)]
    weight: float = 1.0
    args: dict[str, Any] = {}


class ObjectiveSpec(Struct):
    """What the run minimises: language modelling (`lm`), or a preference objective over pairs
    (tokens of `--format preference`; `megacore.models.preference` has the formulas): `dpo` (its
    `loss` sigmoid, with cDPO's `label_smoothing`, or ipo; against a `reference` model), and the
    reference-free `simpo` (`gamma`, the target margin) and `orpo`; `beta` their β. The batch then
    counts pairs, two rows each (or with `data.packing` `pack` rows, each holding whole pairs).

    `reference` (dpo): "base" (`model.init`'s model; under LoRA the base with its adapters off),
    "init" (the model as the run starts: the base with `lora.init`'s adapters), or a checkpoint
    relative to this manifest (a whole model of the run's shapes, or an adapter of the run's base
    and shape); None: "init" when `lora.init` is set, else "base" (`mega_train.reference_plan`).
    `reference_logps`: its log-probabilities computed once before training and stored, or (LoRA
    only) beside each step. `"reference": "live"` or `"precomputed"`, as manifests said it before
    `reference_logps`, still means that.

    `distill`: knowledge distillation from `teacher` (a checkpoint relative to this manifest, frozen,
    of the data's tokenizer; it may be larger): per target token `alpha` x the cross entropy plus
    (1 - `alpha`) x `temperature`² x the `divergence` between the teacher's and the student's token
    distributions at `temperature` (`megacore.parallel.divergence`), averaged over the counted
    targets as the language modelling loss is.

    `grpo`: online RL from verifiable rewards on prompts (tokens of `--format prompts`;
    `megacore.models.grpo` has the formulas): the batch counts prompts, each sampled
    `num_generations` times (up to `max_completion_length` tokens at `temperature`, `top_p`,
    `top_k`: 0 off), the completions scored by `rewards`; `loss` grpo, dapo, bnpo or dr_grpo,
    `scale_rewards`, the clip range `epsilon` (`epsilon_high`: DAPO's clip-higher; None: `epsilon`),
    `beta` the KL penalty's weight (0: no reference), `num_iterations` updates per batch of
    completions, `importance_sampling_level` token or sequence (GSPO), and
    `mask_truncated_completions` (a completion cut at `max_completion_length` counts no token).
    `beta` and `loss` default to the type's: 0.1 and sigmoid, grpo's 0 and dapo (TRL's)."""

    type: Literal["lm", "dpo", "simpo", "orpo", "distill", "grpo"] = "lm"
    beta: NonNegativeFloat | None = None
    loss: Literal["sigmoid", "ipo", "grpo", "dapo", "bnpo", "dr_grpo"] | None = None
    label_smoothing: Annotated[float, msgspec.Meta(ge=0, lt=0.5)] = 0.0
    gamma: NonNegativeFloat = 0.5
    reference: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    reference_logps: Literal["precomputed", "live"] = "precomputed"
    teacher: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    temperature: PositiveFloat = 1.0
    alpha: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    num_generations: Annotated[int, msgspec.Meta(ge=2)] = 8
    max_completion_length: Positive = 256
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0
    epsilon: PositiveFloat = 0.2
    epsilon_high: PositiveFloat | None = None
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: Positive = 1
    importance_sampling_level: Literal["token", "sequence"] = "token"
    mask_truncated_completions: bool = False
    rewards: list[RewardSpec] = []

    def __post_init__(self) -> None:
        if self.reference in REFERENCE_LOGPS:
            self.reference_logps, self.reference = self.reference, None
        grpo = self.type == "grpo"
        if self.beta is None:
            self.beta = 0.0 if grpo else 0.1
        if self.loss is None:
            self.loss = "dapo" if grpo else "sigmoid"


REFERENCE_LOGPS = ("precomputed", "live")
DISTILL_FIELDS = ("teacher", "temperature", "alpha", "divergence")  # `distill`'s settings alone
# `grpo`'s settings alone (with beta, loss and temperature, which it shares)
GRPO_FIELDS = (
    "num_generations", "max_completion_length", "top_p", "top_k", "epsilon", "epsilon_high",
    "scale_rewards", "num_iterations", "importance_sampling_level", "mask_truncated_completions",
    "rewards",
)  # fmt: skip


class RunManifest(Header, tag="run", kw_only=True):
    out: Ref  # the run directory: metrics.jsonl, checkpoints, the data index cache
    model: ModelSpec
    data: DataSpec
    batch: BatchSpec
    train_steps: Positive
    parallel: ParallelSpec = msgspec.field(default_factory=ParallelSpec)
    optimizer: OptimizerSpec = msgspec.field(default_factory=OptimizerSpec)
    # Either spelling; held as the short one (fp32, bf16, fp16); or fp8: bf16 whose block linears
    # run float8 matmuls with `fp8_scaling` (megacore.parallel.fp8).
    precision: Literal[(*FLOAT_DTYPES, *FLOAT_DTYPES.values(), "fp8")] = "bf16"
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    recompute: Literal["none", "full", "selective"] = "none"
    attention: Literal["auto", "sdpa", "flash"] = "auto"
    # torch.compile each transformer block (Decoder.compile_blocks): "auto" where it pays
    # (mega_train.run_plan.RunPlan.compiles), or always / never.
    compile: bool | Literal["auto"] = "auto"
    checkpoint: CheckpointSpec = msgspec.field(default_factory=CheckpointSpec)
    nan: NanSpec = msgspec.field(default_factory=NanSpec)
    watchdog: WatchdogSpec = msgspec.field(default_factory=WatchdogSpec)
    eval: EvalSpec = msgspec.field(default_factory=EvalSpec)
    logging: LoggingSpec = msgspec.field(default_factory=LoggingSpec)
    lora: LoRASpec | None = None
    objective: ObjectiveSpec = msgspec.field(default_factory=ObjectiveSpec)
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.precision != "fp8":
            self.precision = precision_name(self.precision)
