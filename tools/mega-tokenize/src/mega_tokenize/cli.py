"""mega-tokenize command line: parse, call the library, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from mega_tokenize import __version__
from megacore.cli import debug_option, main_for, make_app, version_option
from megacore.progress import plural

if TYPE_CHECKING:
    from mega_tokenize.pipeline import Result  # imported when run, so --help stays instant

app = make_app(
    "Text corpora (jsonl, .zst, .gz, Parquet, Hugging Face datasets) to Megatron-compatible token shards."
)


def _split(values: list[str]) -> list[str]:
    """Repeatable options that also take comma-separated lists."""
    return [v for item in values for v in item.split(",") if v]


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mega-tokenize 'pile/*.jsonl.zst' out/pile-tokens --tokenizer tokenizer.model --workers 8\n\n"
        "  mega-tokenize chats.jsonl out/sft --tokenizer llama3/ --format chat --chat-template tokenizer\n\n"
        "  mega-tokenize my-dataset/ out/ds --tokenizer tokenizer.model --json-key content\n\n"
        "  mega-tokenize hf://datasets/HuggingFaceTB/smoltalk out/sft --tokenizer qwen2.5/ --format chat "
        "--subset all --split train\n\n"
        "  mega-tokenize chats.jsonl out/sft --tokenizer tokenizer.model --format chat "
        "--add-special-tokens '<|im_start|>,<|im_end|>'\n\n"
        "  mega-tokenize pairs.jsonl out/dpo --tokenizer qwen2.5/ --format preference --chat-template tokenizer\n\n"
        "  mega-tokenize gsm8k.jsonl out/grpo --tokenizer qwen2.5/ --format prompts --chat-template tokenizer"
    )
)
def run(
    inputs: list[str] = typer.Argument(
        ...,
        metavar="INPUTS",
        help="Input .jsonl / .jsonl.zst / .jsonl.gz / .parquet files, globs or directories; or one "
        "Hugging Face dataset: hf://datasets/ORG/NAME[@REVISION], a save_to_disk directory, or a "
        "dataset repository's directory (README.md declaring configs).",
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Output tokens artifact directory."),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", "-t", help="SentencePiece .model, tokenizer.json, or a tokenizer directory."
    ),
    json_key: list[str] = typer.Option(
        [],
        "--json-key",
        "-k",
        help="Key (Parquet, dataset: column) of the text in each line, or of the messages with --format chat; "
        "repeat for one output per key. Not with --format preference (prompt, chosen, rejected) or prompts "
        "(prompt, the other keys kept as columns).",
        show_default="text; chat: messages",
    ),
    format: Literal["text", "chat", "preference", "prompts"] = typer.Option(
        "text",
        "--format",
        help="text (pretraining), chat (conversations), preference (DPO pairs) or prompts (online RL: "
        "a prompt a row, its other keys kept as typed columns for the rewards).",
    ),
    chat_template: Literal["chatml", "tokenizer"] = typer.Option(
        "chatml", "--chat-template", help="chatml, or tokenizer (the tokenizer's own jinja template)."
    ),
    append_eos: bool = typer.Option(
        True, "--append-eos/--no-append-eos", help="End every document with EOS (never a prompt)."
    ),
    prepend_bos: bool = typer.Option(
        False, "--prepend-bos/--no-prepend-bos", help="Start every document with BOS."
    ),
    add_special_tokens: list[str] = typer.Option(
        [],
        "--add-special-tokens",
        help="Tokens to add after the vocab (comma-separated or repeated); recorded.",
    ),
    subset: str | None = typer.Option(
        None, "--subset", help="A Hugging Face dataset's subset (config).", show_default="its default"
    ),
    split: str | None = typer.Option(
        None, "--split", help="A Hugging Face dataset's split.", show_default="train"
    ),
    engine: Literal["auto", "sentencepiece", "hf", "gigatoken"] = typer.Option(
        "auto", "--engine", help="Encoder; auto: the fastest that gives the reference's ids."
    ),
    workers: int = typer.Option(1, "--workers", "-j", help="Encoding threads."),
    on_error: Literal["fail", "skip"] = typer.Option(
        "fail", "--on-error", help="fail (exit 2 at the first bad line) or skip (count it)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is a tokens artifact these tools wrote from other inputs."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress line on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
    version: bool = version_option("mega-tokenize", __version__),
    debug: bool = debug_option(),
) -> None:
    """Tokenize INPUTS... into the tokens artifact OUT (Megatron MMIDIDX shards + manifest)."""
    from mega_tokenize.pipeline import Options, tokenize

    opts = Options(
        inputs=inputs,
        out=out,
        tokenizer=tokenizer,
        json_keys=_split(json_key),
        format=format,
        chat_template=chat_template,
        append_eos=append_eos,
        prepend_bos=prepend_bos,
        add_special_tokens=_split(add_special_tokens),
        subset=subset,
        split=split,
        engine=engine,
        workers=workers,
        on_error=on_error,
        force=force,
        progress=progress,
    )
    res = tokenize(opts)
    _report(res, opts.out)
    if as_json:
        print(json.dumps(_summary(res, opts.out)))


def _report(res: Result, out: Path) -> None:
    """What was written (or that it was reused) and the first skipped lines, on stderr."""
    m = res.manifest
    c = m.counts
    if res.reused:
        print(
            f"mega-tokenize: {out} is already complete with these inputs and settings; reused",
            file=sys.stderr,
        )
        return
    mbs = res.input_bytes / max(res.seconds, 1e-9) / 1e6
    docs = plural(c.documents, "document")
    if m.format == "preference":
        docs = f"{plural(c.pairs, 'pair')} ({docs})"
    print(
        f"mega-tokenize: {out}: {docs}, {plural(c.tokens, 'token')} ({m.dtype}), "
        f"{plural(c.skipped_lines, 'skipped line')}, engine {m.engine}, {res.seconds:.1f}s, {mbs:.1f} MB/s",
        file=sys.stderr,
    )
    for ex in c.skipped_examples:
        print(f"mega-tokenize: skipped {ex}", file=sys.stderr)


def _summary(res: Result, out: Path) -> dict:
    """The --json summary on stdout."""
    m = res.manifest
    c = m.counts
    return {
        "out": str(out),
        "reused": res.reused,
        "documents": c.documents,
        **({"pairs": c.pairs} if m.format == "preference" else {}),
        "tokens": c.tokens,
        "skipped_lines": c.skipped_lines,
        "dtype": m.dtype,
        "engine": m.engine,
        "vocab_size": m.tokenizer.vocab_size,
        "shards": [s.prefix for s in m.shards],
        "seconds": round(res.seconds, 3),
    }


main = main_for(app, "mega-tokenize")
