"""The artifacts a run manifest names, opened and checked without torch: the model the run trains
(`open_init`, `model_config`: a checkpoint as `init`, with the context a run from it may set; a
`config`; or a Hugging Face config.json, `read_hf_config`) and
the data sources (`open_sources`), which share one tokenizer, the init checkpoint's where it records
one (`check_init_tokenizer`). `run_plan.plan_run` calls them in that order.
"""

from __future__ import annotations

from pathlib import Path

from mega_train.objectives import check_data
from megacore.artifacts import CheckpointManifest, RunManifest, TokensManifest, open_artifact, resolve_ref
from megacore.artifacts.reader import Verify, check_model_tensors
from megacore.config import (
    CONTEXT_FIELDS,
    DEFAULT_PAD_MULTIPLE,
    ModelConfig,
    with_context,
)
from megacore.config_parts import RopeScaling
from megacore.data.indexed import IndexedReader
from megacore.errors import UserError
from megacore.tokenizer_files import first_difference, recorded_vocabulary

# --- the model ---------------------------------------------------------------------------------


def open_init(
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


def model_config(
    run: RunManifest, init: tuple[Path, CheckpointManifest] | None, base: Path, where: str
) -> tuple[ModelConfig, list[str]]:
    """The model the run trains (the config its checkpoints record) and a note when it is not the
    init's: `config`, a Hugging Face config.json's (`hf_config`), or the init's with the context
    `max_seq_len` and `rope_scaling` set."""
    m = run.model
    if init is None:
        for name in CONTEXT_FIELDS.values():
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
    try:
        config = with_context(before, m.max_seq_len, m.rope_scaling)
    except ValueError as e:  # llama3 / yarn without the original context
        raise UserError(f"$.model: {e}", where) from None
    if config == before:
        return config, []
    note = (
        f"the model's context: {config.max_seq_len:,} positions (the init's {before.max_seq_len:,}), "
        f"RoPE {_describe_rope(config.rope.scaling)}; the run's checkpoints record this config"
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


# --- the data ----------------------------------------------------------------------------------


def open_sources(
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


def _check_tokens(
    i: int, path: Path, tokens: TokensManifest, config: ModelConfig, run: RunManifest, where: str
) -> None:
    """Source i: its ids fit the model's vocab, it holds what the run's loss and objective need,
    documents, and a readable index for every shard."""
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


def check_init_tokenizer(
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
