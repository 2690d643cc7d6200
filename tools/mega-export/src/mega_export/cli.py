"""mega-export command line: parse, call the library, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import typer

from mega_export import __version__
from megacore.artifacts.header import FloatName
from megacore.cli import debug_option, main_for, make_app, version_option
from megacore.errors import UserError
from megacore.progress import plural

app = make_app("Checkpoint artifact (any layout) to a Hugging Face model directory.")


@app.command()
def export(
    checkpoint: Path = typer.Argument(
        ..., metavar="CHECKPOINT", help="Checkpoint artifact, in any tp/pp/dp layout."
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Hugging Face model directory to write."),
    dtype: FloatName | None = typer.Option(
        None, "--dtype", help="Weight dtype of the export (default: the checkpoint's)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is an export these tools wrote from other inputs."
    ),
    adapter: bool = typer.Option(
        False,
        "--adapter",
        help="CHECKPOINT is a LoRA adapter: write it as a PEFT adapter directory (default: the model "
        "with the adapter merged in).",
    ),
    base: Path | None = typer.Option(
        None, "--base", metavar="CKPT", help="A LoRA adapter's base checkpoint, when it moved since training."
    ),
    merge_into: Literal["nf4", "original"] | None = typer.Option(
        None,
        "--merge-into",
        help="A LoRA adapter merged into its base as QLoRA trained against it (nf4: the base's "
        "projections NF4-dequantized, the default for a QLoRA adapter) or as stored (original, the "
        "default for any other).",
    ),
    push_to_hub: str | None = typer.Option(
        None,
        "--push-to-hub",
        metavar="REPO",
        help="Then upload OUT to this Hugging Face model repo (created if missing); token: HF_TOKEN "
        "or `hf auth login`, never printed.",
    ),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repo private."),
    revision: str | None = typer.Option(
        None, "--revision", help="With --push-to-hub: the branch to commit to (created from main if missing)."
    ),
    commit_message: str | None = typer.Option(
        None, "--commit-message", help="With --push-to-hub: the commit's message."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="With --push-to-hub: list the files and sizes it would upload, upload nothing.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
    version: bool = version_option("mega-export", __version__),
    debug: bool = debug_option(),
) -> None:
    """Write CHECKPOINT as a Hugging Face model directory OUT that `transformers` loads directly.

    Example: mega-export ckpt-tp8pp4 hf-out && python -c "import transformers as t;
    t.AutoModelForCausalLM.from_pretrained('hf-out')"
    """
    from mega_export.export import export_hf  # torch is imported only once there is work

    pushing = (
        ("--private", private),
        ("--revision", revision),
        ("--commit-message", commit_message),
        ("--dry-run", dry_run),
    )
    stray = [flag for flag, given in pushing if given]
    if stray and push_to_hub is None:
        raise UserError(f"{stray[0]} is an option of --push-to-hub REPO, which is not given")
    s = export_hf(
        checkpoint, out, dtype=dtype, force=force, adapter=adapter, base=base, merge_into=merge_into
    )
    if not as_json:
        _report(s, out)
    if push_to_hub is not None:
        s["push"] = _push(out, push_to_hub, private, revision, commit_message, dry_run, as_json)
    if as_json:
        typer.echo(json.dumps(s, indent=2))


def _report(s: dict[str, Any], out: Path) -> None:
    """What was written (stdout), or that it was reused (stderr)."""
    if s["reused"]:
        print(f"mega-export: {out} is already this export; reused (pass --force to rebuild)", file=sys.stderr)
    else:
        typer.echo(
            f"wrote {out}: {s['family']}, {plural(s['tensors'], 'tensor')} in {plural(len(s['files']), 'file')}, {s['dtype']}"
        )


def _push(
    out: Path,
    repo: str,
    private: bool,
    revision: str | None,
    commit_message: str | None,
    dry_run: bool,
    as_json: bool,
) -> dict[str, Any]:
    """Upload OUT to `repo` (with `dry_run`, list what would be uploaded); the summary's "push"."""
    from mega_export.hub import push, upload_files

    files = upload_files(out)
    summary: dict[str, Any] = {"repo": repo, "revision": revision or "main", "dry_run": dry_run,
                               "files": [{"path": p, "bytes": n} for p, n in files]}  # fmt: skip
    if dry_run and not as_json:
        typer.echo(f"would upload to {repo} ({revision or 'main'}):")
        for path, size in files:
            typer.echo(f"  {size:>14,}  {path}")
        typer.echo(f"  {sum(n for _, n in files):>14,}  bytes in {plural(len(files), 'file')}")
    if not dry_run:
        summary["commit"] = push(out, repo, private=private, revision=revision, commit_message=commit_message)
        if not as_json:
            typer.echo(f"pushed {out} to {repo}: {summary['commit']}")
    return summary


main = main_for(app, "mega-export")
