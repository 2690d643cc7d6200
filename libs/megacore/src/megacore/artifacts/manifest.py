"""Manifest structs for every artifact kind (docs/architecture.md, "The artifact contract").

One `manifest.json` describes one artifact directory. Decoding (`megacore.artifacts.codec`) is
strict: unknown fields are rejected, types and ranges are checked, and a `format_version` newer than
this library knows is refused before anything else is looked at. `schemas/*.schema.json` is
generated from these structs (`make schemas`); a test fails when the two drift apart.

The fields every kind shares (the header, typed paths, dtypes) are `header.py`'s; the run
manifest's sections `run_spec.py`'s. Here: the tokens, checkpoint and Hugging Face manifests, and
the union of every kind.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from megacore.artifacts.header import (
    DType,
    FilePath,
    Header,
    Kind,
    LoRATarget,
    NonNegative,
    Prefix,
    Record,
    Ref,
)
from megacore.artifacts.run_spec import RunManifest
from megacore.config import ModelConfig, Positive, PositiveFloat, Struct

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
    columns: FilePath | None = None  # prompts: a Parquet file of the rows (prompt and columns), a row each


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
    format: Literal["text", "chat", "preference", "prompts"] = "text"
    append_eos: bool = True
    prepend_bos: bool = False
    chat_template: str | None = None
    roles: dict[str, int] = {}
    # prompts: the Arrow type of each column of the rows, the prompt as given among them (`Shard.columns`)
    column_types: dict[str, str] = {}
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


Manifest = TokensManifest | CheckpointManifest | RunManifest | HFManifest
MANIFEST_TYPES: dict[str, type[Header]] = {
    "tokens": TokensManifest,
    "checkpoint": CheckpointManifest,
    "run": RunManifest,
    "hf": HFManifest,
}


def kind_of(manifest: Manifest) -> Kind:
    return type(manifest).__struct_config__.tag  # type: ignore[return-value]
