"""The model card (`README.md` of an export) from the checkpoint's lineage: what it was trained from
and on (the init checkpoint, the tokens artifacts with their token counts where they can still be
read), for how long (steps, tokens), in which layout, with which final losses and tokenizer, under
which license (the source model's, as mega-convert read it from its card).

A card is published: artifacts are named by their directory's name and the sha256 of their
manifest, never by a local path (which would show a user name or a cluster's layout)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megacore.artifacts import CheckpointManifest, TokensManifest, open_artifact
from megacore.artifacts.manifest import Parent
from megacore.errors import UserError


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


def model_card(name: str, manifest: CheckpointManifest) -> str:
    """README.md text for the export named `name` of the checkpoint `manifest`."""
    cfg, t = manifest.config, manifest.training
    front = ["---"]
    lic = manifest.license
    if lic is not None:
        for key, value in (("license", lic.id), ("license_name", lic.name), ("license_link", lic.link)):
            if value:  # YAML: a plain id as is, anything else quoted (JSON strings are YAML)
                front.append(
                    f"{key}: {value if re.fullmatch(r'[A-Za-z0-9][A-Za-z0-9._-]*', value) else json.dumps(value)}"
                )
    front += ["library_name: transformers", "tags:", "- mega-train" if t else "- mega-convert", "---", ""]
    lines = [f"# {name}", ""]
    producer = f"{manifest.producer.name} {manifest.producer.version}" if manifest.producer else "unknown"
    lines += [
        f"A {cfg.family} decoder ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"{cfg.num_kv_heads} kv heads, vocab {cfg.vocab_size}, context {cfg.max_seq_len}), exported by "
        f"mega-export from a checkpoint written by {producer}.",
        "",
        "| | |",
        "| --- | --- |",
    ]
    base = [p for p in manifest.parents if p.kind == "checkpoint"]
    data = [p for p in manifest.parents if p.kind == "tokens"]
    if base:
        lines.append(f"| base model | {', '.join(_name(b) for b in base)}, a checkpoint |")
    elif t is not None:
        lines.append("| base model | none: trained from fresh weights |")
    for i, d in enumerate(data):
        lines.append(f"| training data{'' if len(data) == 1 else f' {i + 1}'} | {_tokens_line(d)} |")
    if t is not None:
        lines.append(f"| steps | {t.step:,} ({t.consumed_samples:,} samples) |")
        for key, label in (("train_loss", "final train loss"), ("valid_loss", "final valid loss")):
            if key in t.metrics:
                lines.append(f"| {label} | {t.metrics[key]:.4f} |")
    if lic is not None:
        lines.append(
            f"| license | {lic.id}{f' ({lic.name})' if lic.name else ''}, from the source model's card |"
        )
    lay = manifest.layout
    lines.append(f"| layout | tp {lay.tp} x pp {lay.pp} x dp {lay.dp}, {manifest.dtype} |")
    if manifest.tokenizer is not None:
        tok = manifest.tokenizer
        chat = {None: "", "chatml": "; chat: ChatML"}.get(
            tok.chat_template, "; chat: the tokenizer's template"
        )
        added = f", added {', '.join(tok.info.added_special_tokens)}" if tok.info.added_special_tokens else ""
        lines.append(f"| tokenizer | {tok.info.type}, {tok.info.vocab_size:,} ids{added}{chat} |")
    lines += ["", "Load it with `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer`.", ""]
    return "\n".join(front + lines)
