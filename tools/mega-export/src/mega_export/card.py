"""The model card (`README.md` of an export) from the checkpoint's lineage: what it was trained from
and on (the init checkpoint, the tokens artifacts with their token counts where they can still be
read), for how long (steps, tokens), in which layout, with which final losses and tokenizer, under
which license (the source model's, as mega-convert read it from its card); for a mixture of experts,
its experts, how many a token goes to and its parameters, all and active.

A card is published: artifacts are named by their directory's name and the sha256 of their
manifest, never by a local path (which would show a user name or a cluster's layout)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from mega_export.adapter import BASE_QUANTIZATION
from megacore.artifacts import CheckpointManifest, TokensManifest, open_artifact
from megacore.artifacts.header import Parent
from megacore.artifacts.manifest import Adapter, TrainedTokenizer
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.parallel.layout import is_experts
from megacore.planner.counts import parameter_counts


def _name(p: Parent) -> str:
    return f"`{Path(p.path).name}` (manifest sha256 {p.manifest_sha256[:12]})"


def _tokens_line(p: Parent) -> str:
    try:
        tokens = open_artifact(Path(p.path), "tokens", verify="none")
    except UserError:  # moved or deleted since: the lineage keeps its name and sha256
        return _name(p)
    assert isinstance(tokens, TokensManifest)
    c = tokens.counts
    return f"{_name(p)}: {c.documents:,} documents, {c.tokens:,} tokens ({tokens.format}, {tokens.tokenizer.type} tokenizer)"


def _front_matter(manifest: CheckpointManifest) -> list[str]:
    """The YAML the Hub reads: the license, the library, where the weights came from."""
    front = ["---"]
    lic = manifest.license
    if lic is not None:
        for key, value in (("license", lic.id), ("license_name", lic.name), ("license_link", lic.link)):
            if value:  # YAML: a plain id as is, anything else quoted (JSON strings are YAML)
                front.append(
                    f"{key}: {value if re.fullmatch(r'[A-Za-z0-9][A-Za-z0-9._-]*', value) else json.dumps(value)}"
                )
    tag = "- mega-train" if manifest.training else "- mega-convert"
    return [*front, "library_name: transformers", "tags:", tag, "---", ""]


def _experts_rows(cfg: ModelConfig) -> list[str]:
    """A mixture of experts' routing and its parameters: all of them, and those a token passes through."""
    moe = cfg.moe
    if moe is None:
        return []
    how = "renormalised to sum to 1" if moe.router.renormalize_top_k else "the softmax's, not renormalised"
    # Counted as the export holds them: the vocab rows without the checkpoint's padding.
    total, active = parameter_counts(msgspec.structs.replace(cfg, padded_vocab_size=cfg.vocab_size))
    where = "every layer"
    if moe.dense_layers:
        where = f"every layer but {', '.join(map(str, moe.dense_layers))} (dense)"
    shared = ""
    if moe.shared_expert is not None:
        shared = (
            f", beside a shared expert every token goes through{' (gated)' if moe.shared_expert.gate else ''}"
        )
    return [
        f"| experts | {moe.num_experts} in {where}, top {moe.experts_per_token} per token, "
        f"their routing weights {how}{shared} |",
        f"| parameters | {total:,} in all, {active:,} active per token |",
    ]


def _layout_row(manifest: CheckpointManifest) -> str:
    """The layout the weights were saved in; a mixture of experts' adds how its experts were split
    (ep), which the experts' pieces record: one piece-row of experts per ep rank."""
    lay = manifest.layout
    ep = _experts_split(manifest)
    experts = f", the experts over ep {ep} of the dp ranks" if ep is not None else ""
    return f"| layout | tp {lay.tp} x pp {lay.pp} x dp {lay.dp}{experts}, {manifest.dtype} |"


def _experts_split(manifest: CheckpointManifest) -> int | None:
    """How many parts the pieces of a mixture of experts' stacked experts cut them into along the
    experts (its ep layout, as a run at ep saves and `mega-shard --ep` writes); None for a dense model."""
    if manifest.config.moe is None:
        return None
    name = next(n for n in manifest.tensors if is_experts(n))
    return len({piece.offset[0] for piece in manifest.tensors[name].pieces})


def _lineage_rows(manifest: CheckpointManifest) -> list[str]:
    """Where the weights came from: the base checkpoint, the data, the steps and final losses."""
    t, rows = manifest.training, []
    base = [p for p in manifest.parents if p.kind == "checkpoint"]
    data = [p for p in manifest.parents if p.kind == "tokens"]
    if base:
        rows.append(f"| base model | {', '.join(_name(b) for b in base)}, a checkpoint |")
    elif t is not None:
        rows.append("| base model | none: trained from fresh weights |")
    for i, d in enumerate(data):
        rows.append(f"| training data{'' if len(data) == 1 else f' {i + 1}'} | {_tokens_line(d)} |")
    if t is not None:
        rows.append(f"| steps | {t.step:,} ({t.consumed_samples:,} {t.consumed_unit}) |")
        for key, label in (("train_loss", "final train loss"), ("valid_loss", "final valid loss")):
            if key in t.metrics:
                rows.append(f"| {label} | {t.metrics[key]:.4f} |")
    return rows


def _tokenizer_row(tok: TrainedTokenizer) -> str:
    chat = {None: "", "chatml": "; chat: ChatML"}.get(tok.chat_template, "; chat: the tokenizer's template")
    added = f", added {', '.join(tok.info.added_special_tokens)}" if tok.info.added_special_tokens else ""
    return f"| tokenizer | {tok.info.type}, {tok.info.vocab_size:,} ids{added}{chat} |"


def _adapter_row(info: Adapter, merged_into: str | None) -> str:
    """A LoRA adapter's settings, what it was trained on, and (merged) into which base it went."""
    row = f"| LoRA adapter | rank {info.rank}, alpha {info.alpha:g} on {', '.join(sorted(info.targets))}"
    nf4 = info.nf4
    if info.base_dtype == "nf4" and nf4 is not None:
        row += (
            f"; trained on its base's block projections in NF4 (QLoRA: blocks of {nf4.block}, the scales "
            f"in int8 blocks of {nf4.scaler_block}, torchao)"
        )
    if merged_into == "nf4":
        row += "; merged into that NF4 base dequantized, the model as it trained"
    elif merged_into == "original":
        extra = ", not the NF4 one it trained on" if info.base_dtype == "nf4" else ""
        row += f"; merged into its base as stored{extra}"
    else:
        row += "; a PEFT adapter directory" + (f" ({BASE_QUANTIZATION} says how)" if nf4 is not None else "")
    return row + " |"


def model_card(name: str, manifest: CheckpointManifest, merged_into: str | None = None) -> str:
    """README.md text for the export named `name` of the checkpoint `manifest` (a LoRA adapter's:
    `merged_into` nf4 or original, or None for a PEFT directory)."""
    cfg, lic = manifest.config, manifest.license
    producer = f"{manifest.producer.name} {manifest.producer.version}" if manifest.producer else "unknown"
    lines = [
        f"# {name}",
        "",
        f"A {cfg.family} decoder ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"{cfg.num_kv_heads} kv heads, vocab {cfg.vocab_size}, context {cfg.max_seq_len}), exported by "
        f"mega-export from a checkpoint written by {producer}.",
        "",
        "| | |",
        "| --- | --- |",
        *_experts_rows(cfg),
        *_lineage_rows(manifest),
    ]
    if lic is not None:
        lines.append(
            f"| license | {lic.id}{f' ({lic.name})' if lic.name else ''}, from the source model's card |"
        )
    if manifest.adapter is not None:
        lines.append(_adapter_row(manifest.adapter, merged_into))
    lines.append(_layout_row(manifest))
    if manifest.tokenizer is not None:
        lines.append(_tokenizer_row(manifest.tokenizer))
    lines += ["", "Load it with `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer`.", ""]
    return "\n".join(_front_matter(manifest) + lines)
