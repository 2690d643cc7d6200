"""Manifest structs for every artifact kind (docs/architecture.md, "The artifact contract").

One `manifest.json` describes one artifact directory. Decoding (`megacore.artifacts.codec`) is
strict: unknown fields are rejected, types and ranges are checked, and a `format_version` newer than
this library knows is refused before anything else is looked at. `schemas/*.schema.json` is
generated from these structs (`make schemas`); a test fails when the two drift apart.

Every path field is typed by what it points at (`x-path` in the schemas), so that one function,
`megacore.artifacts.reader.check_paths`, finds and checks all of them:
- `file`: a file of this artifact: relative, confined to its directory, listed in `files`;
- `prefix`: `<prefix>.bin` and `<prefix>.idx` of this artifact, each as a `file`;
- `ref`: a path outside the artifact (a run manifest's inputs and outputs), resolved against the
  manifest's directory, never the working directory;
- `record`: provenance (a parent's or an input's path as given); recorded, never opened.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

from megacore.config import ModelConfig, Positive, PositiveFloat, RopeScaling, Struct
from megacore.errors import UserError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

Kind = Literal["tokens", "checkpoint", "run", "hf"]
DType = Literal["float32", "bfloat16", "float16", "int64", "int32", "uint16", "uint8"]
# The float dtypes' two spellings, the one alias table: a tool's --dtype and a run manifest's
# `precision` take either, normalised by `float_dtype` / `precision_name`; what is written stays
# canonical (a tensor's dtype long, a run's precision short), so older readers read it.
FLOAT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FloatName = Literal[(*FLOAT_DTYPES, *FLOAT_DTYPES.values())]
_LONG_NAMES = {
    **{long: long for long in FLOAT_DTYPES},
    **{short: long for long, short in FLOAT_DTYPES.items()},
}
Schedule = Literal["gpipe", "1f1b", "interleaved1f1b", "zbv", "interleavedzb"]


def float_dtype(name: str, where: str = "--dtype") -> str:
    """A float dtype in either spelling (bf16 or bfloat16) as its long name (bfloat16)."""
    if name not in _LONG_NAMES:
        raise UserError(f"expected one of {', '.join(_LONG_NAMES)}, got {name!r}", where)
    return _LONG_NAMES[name]


def precision_name(name: str, where: str = "$.precision") -> str:
    """A float dtype in either spelling as its short name (bf16), as a run's `precision` is held."""
    return FLOAT_DTYPES[float_dtype(name, where)]


def _path(kind: str) -> object:
    return msgspec.Meta(extra_json_schema={"x-path": kind})


FilePath = Annotated[str, _path("file")]
Prefix = Annotated[str, _path("prefix")]
Ref = Annotated[str, _path("ref")]
Record = Annotated[str, _path("record")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


# --- common header -------------------------------------------------------------------------------


class Producer(Struct):
    name: str
    version: str


class Parent(Struct):
    """An input artifact: path as given on the command line, its kind and its manifest's sha256."""

    path: Record
    kind: Kind
    manifest_sha256: str


class FileEntry(Struct):
    """A data file of the artifact; `path` is relative and confined to the artifact directory."""

    path: FilePath
    size: NonNegative
    sha256: str


class Header(Struct, tag_field="kind", kw_only=True):
    """Fields every kind has. `recipe_sha256` hashes what decides the artifact's content (its
    inputs' identities and the settings): a rerun with the same recipe reuses the artifact."""

    format_version: int
    producer: Producer | None = None
    created_at: str | None = None
    parents: list[Parent] = []
    files: list[FileEntry] = []
    recipe_sha256: str | None = None


# --- tokens --------------------------------------------------------------------------------------


class TokenizerInfo(Struct):
    """The tokenizer the ids came from; its files are copied into the artifact (`files`, relative).

    `vocab_size` includes `added_special_tokens` (ids the tokenizer did not have, given on the
    command line); `base_vocab_size` is the tokenizer's own. `stop_ids`: every id that ends
    generation where the tokenizer's directory names them (generation_config.json's
    `eos_token_id`: Llama 3.1 has three)."""

    type: Literal["sentencepiece", "hf"]
    files: list[FilePath]
    vocab_size: Positive
    fingerprint: str
    base_vocab_size: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    added_special_tokens: dict[str, int] = {}
    stop_ids: list[NonNegative] = []


class Shard(Struct):
    """One Megatron `MMIDIDX` pair: `<prefix>.bin` and `<prefix>.idx` (plus optional sidecars,
    e.g. `{"roles": "<prefix>.roles"}`: one uint8 role code per token, with the same index)."""

    prefix: Prefix
    json_key: str
    documents: NonNegative
    tokens: NonNegative
    sidecars: dict[str, Prefix] = {}


class TokenCounts(Struct):
    documents: int = 0
    pairs: int = 0  # preference pairs (format "preference": documents 2k and 2k + 1 are pair k's)
    tokens: int = 0
    skipped_lines: int = 0
    skipped_examples: list[str] = []  # the first few skipped lines, `file:line: what is wrong`


class InputFile(Struct):
    """An input corpus file as it was read; size and mtime tell a rerun whether it changed."""

    path: Record
    size: int
    mtime_ns: int


class InputDataset(Struct):
    """A Hugging Face dataset read as the input (its files, where local, are in `inputs`): `path` as
    given (`hf://datasets/ORG/NAME`, or a directory), what it is (`hub`, `saved`: written by
    `save_to_disk`, `repository`: a dataset repository's files with its README's configs), the
    Hub commit it was read at (None: a local directory that is not a Hub snapshot), its subset (the
    config) and split."""

    path: Record
    kind: Literal["hub", "saved", "repository"]
    revision: str | None = None
    subset: str | None = None
    split: str | None = None


class TokensManifest(Header, tag="tokens", kw_only=True):
    tokenizer: TokenizerInfo
    dtype: Literal["uint16", "int32"]
    format: Literal["text", "chat", "preference"] = "text"
    append_eos: bool = True
    prepend_bos: bool = False
    chat_template: str | None = None
    roles: dict[str, int] = {}
    engine: str | None = None
    json_keys: list[str] = []
    on_error: Literal["fail", "skip"] = "fail"
    inputs: list[InputFile] = []
    dataset: InputDataset | None = None
    settings_sha256: str | None = None  # written before recipe_sha256 existed; read, no longer written
    shards: list[Shard] = []
    counts: TokenCounts = msgspec.field(default_factory=TokenCounts)


# --- checkpoint ----------------------------------------------------------------------------------


class Piece(Struct):
    """A rectangular block of a logical tensor stored as `key` in safetensors file `file`."""

    file: FilePath
    key: str
    offset: list[NonNegative]
    shape: list[NonNegative]
    # Of the piece's raw bytes (its `data_offsets` range in the file), so a reader hashes only what
    # it reads; None in checkpoints written before it existed (their readers hash whole files).
    sha256: str | None = None


class TensorEntry(Struct):
    shape: list[NonNegative]
    dtype: DType
    pieces: list[Piece]


class Layout(Struct):
    """How the tensors were split when written: tp, pp, dp shards (FSDP2's: dp x cp) and the
    layers of each stage."""

    tp: Positive = 1
    pp: Positive = 1
    dp: Positive = 1
    stage_layers: list[list[int]] = []


class TrainingState(Struct):
    """Resume state beside the weights; readers that want weights only ignore it.

    `fingerprint` (`run` in the JSON) is what a resumed run must share with the one that saved (the
    data sources, split, seed, sequence length, batch size, optimizer), by field path, so a refusal
    names the field;
    `rng_files` hold each rank's RNG states."""

    step: NonNegative
    consumed_samples: NonNegative = 0
    # What `consumed_samples` counts: what the run's batch sizes count (its objective's samples:
    # sequences, pairs, or rows of packed pairs). Checkpoints before it counted data rows: sequences.
    consumed_unit: str = "sequences"
    scheduler: dict[str, float | int | str] = {}
    optimizer: str | None = None
    optimizer_steps: NonNegative | None = None  # updates applied (skipped steps make it < step)
    loss_scale: PositiveFloat | None = None  # fp16's dynamic loss scale
    counters: dict[str, NonNegative] = {}  # skipped steps, non-finite steps
    fingerprint: dict[str, str] = msgspec.field(default_factory=dict, name="run")
    rng_files: list[FilePath] = []
    metrics: dict[str, float] = {}  # the last train loss and evaluation loss by this step (model cards)


class TrainedTokenizer(Struct):
    """The tokenizer a checkpoint's weights were trained with: its training data's, as mega-tokenize
    recorded it (files copied into the checkpoint, `info.files` relative to it), and how the data
    used it (`chat_template`: the tokens artifact's, `prepend_bos`). mega-export writes the Hugging
    Face tokenizer from it."""

    info: TokenizerInfo
    chat_template: str | None = None  # "chatml", or the tokenizer's own template (jinja)
    prepend_bos: bool = False


class License(Struct):
    """The weights' license as the source model's card states it (the front matter of its
    README.md): `id` is its `license` (`apache-2.0`, `llama2`, `other`...), `name` and `link` its
    `license_name` and `license_link` (for `other`)."""

    id: str
    name: str | None = None
    link: str | None = None


LoRATarget = Annotated[str, msgspec.Meta(min_length=1)]


class HFSource(Struct):
    """The HF model mega-convert read: its directory (absolute), Hub id and commit (a cache snapshot)."""

    path: Record
    repo: str | None = None
    revision: str | None = None


class BaseModel(Struct):
    """The checkpoint an adapter belongs to, by its manifest's sha256, at `relative` (to the adapter's
    directory) or `path` (absolute; older: as given); `hf_source`: the base's, a PEFT export's base."""

    path: Record
    manifest_sha256: str
    relative: Ref | None = None
    hf_source: HFSource | None = None


class NF4Blocks(Struct):
    """How a QLoRA run quantized its base's block projections (`megacore.models.nf4`, from fp32,
    each tensor whole): an absmax scale per `block` values, the scales quantized to int8 in blocks
    of `scaler_block` (at most: `megacore.config.nf4_scaler_block`)."""

    block: Positive
    scaler_block: Positive


class Adapter(Struct):
    """A LoRA adapter checkpoint (`megacore.models.adapters`): it holds the low-rank matrices
    (`<module>.lora_A.weight` [rank, in], `<module>.lora_B.weight` [out, rank]) of the `targets`
    (Hugging Face module names, PEFT's `target_modules`) and their moments, not the base's weights;
    `config` is the base's. The update is scale · B A, scale = alpha / rank (alpha / sqrt(rank)
    with `rslora`)."""

    rank: Positive
    alpha: PositiveFloat
    targets: Annotated[list[LoRATarget], msgspec.Meta(min_length=1)]
    base: BaseModel
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    rslora: bool = False
    # QLoRA: the base the adapters were trained against, its block projections in NF4 (None: as
    # stored); mega-export merges into it as trained.
    base_dtype: Literal["nf4"] | None = None
    nf4: NF4Blocks | None = None


class CheckpointManifest(Header, tag="checkpoint", kw_only=True):
    """`tokenizer_files`: a Hugging Face model's tokenizer files as mega-convert found them;
    `tokenizer`: the tokenizer of the data the weights were trained on (mega-train); `license`: the
    source model's, carried by every tool that derives weights from it; `adapter`: set for a LoRA
    adapter, whose tensors are the adapter's and whose config is its base's; `hf_source`: mega-convert's."""

    config: ModelConfig
    dtype: DType
    layout: Layout = msgspec.field(default_factory=Layout)
    tensors: dict[str, TensorEntry] = {}
    tokenizer_files: list[FilePath] = []
    tokenizer: TrainedTokenizer | None = None
    training: TrainingState | None = None
    license: License | None = None
    adapter: Adapter | None = None
    hf_source: HFSource | None = None


# --- hf ------------------------------------------------------------------------------------------


class HFManifest(Header, tag="hf", kw_only=True):
    """A Hugging Face model directory written by mega-export (config.json, safetensors, tokenizer
    files): transformers ignores this manifest; it records lineage and lets a rerun reuse or
    replace the directory, which no tool does to a directory it did not write."""

    dtype: DType


# --- run -----------------------------------------------------------------------------------------


class ModelSpec(Struct):
    """Start from a checkpoint artifact (`init`), or from scratch with a `config`, or with the
    model a Hugging Face `config.json` describes (`hf_config`: the file, or a model directory
    holding one; the weights are not read, so a dry run plans a model not downloaded). Beside `init`,
    `max_seq_len` and `rope_scaling` set the context the run trains for (context extension: a
    longer max_seq_len with a RoPE scaling), the router losses' coefficients their weights and
    `router_bias_update` the balancing bias's step (a mixture of experts), every other field of the model staying the init's; the run's checkpoints
    record the config that results (`megacore.config.with_context`)."""

    init: Ref | None = None
    config: ModelConfig | None = None
    hf_config: Ref | None = None
    max_seq_len: Positive | None = None  # None: the init's
    rope_scaling: RopeScaling | None = None  # None: the init's
    # A mixture of experts' router losses (None: the init's; `ModelConfig` has the meaning).
    router_aux_loss_coef: NonNegativeFloat | None = None
    router_z_loss_coef: NonNegativeFloat | None = None
    # DeepSeek V3's auxiliary-loss-free balancing: the router bias's step (None: the init's, 0 off).
    router_bias_update: NonNegativeFloat | None = None
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
    targets as the language modelling loss is."""

    type: Literal["lm", "dpo", "simpo", "orpo", "distill"] = "lm"
    beta: PositiveFloat = 0.1
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: Annotated[float, msgspec.Meta(ge=0, lt=0.5)] = 0.0
    gamma: NonNegativeFloat = 0.5
    reference: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    reference_logps: Literal["precomputed", "live"] = "precomputed"
    teacher: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    temperature: PositiveFloat = 1.0
    alpha: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"

    def __post_init__(self) -> None:
        if self.reference in REFERENCE_LOGPS:
            self.reference_logps, self.reference = self.reference, None


REFERENCE_LOGPS = ("precomputed", "live")
DISTILL_FIELDS = ("teacher", "temperature", "alpha", "divergence")  # `distill`'s settings alone


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


Manifest = TokensManifest | CheckpointManifest | RunManifest | HFManifest
MANIFEST_TYPES: dict[str, type[Header]] = {
    "tokens": TokensManifest,
    "checkpoint": CheckpointManifest,
    "run": RunManifest,
    "hf": HFManifest,
}


def kind_of(manifest: Manifest) -> Kind:
    return type(manifest).__struct_config__.tag  # type: ignore[return-value]


def new_header_fields(producer: str, version: str) -> dict:
    """The header values a writer fills in: producer, creation time and the current format."""
    return {
        "format_version": FORMAT_VERSION,
        "producer": Producer(name=producer, version=version),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
