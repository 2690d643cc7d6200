"""mega-export command line: parse, call the library, report."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mega_export import __version__
from megacore.cli import debug_option, main_for, make_app, version_option

app = make_app("Checkpoint artifact (any layout) to a Hugging Face model directory.")


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="Checkpoint artifact, in any tp/pp/dp layout."),
    out: Path = typer.Argument(..., help="Hugging Face model directory to write."),
    dtype: str = typer.Option(
        None, "--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
    version: bool = version_option("mega-export", __version__),
    debug: bool = debug_option(),
) -> None:
    """Write CHECKPOINT as a Hugging Face model directory that `transformers` loads directly.

    Example: mega-export ckpt-tp8pp4 hf-out && python -c "import transformers as t;
    t.AutoModelForCausalLM.from_pretrained('hf-out')"
    """
    from megacore.models.hf import write_hf_dir  # torch is imported only once there is work

    summary = write_hf_dir(checkpoint, out, dtype=dtype, force=force)
    typer.echo(json.dumps(summary, indent=2, default=str) if as_json else f"wrote {out}")


main = main_for(app, "mega-export")
