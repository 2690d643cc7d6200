"""mega-export command line: parse, call the library, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import typer

from mega_export import __version__
from megacore.cli import debug_option, main_for, make_app, version_option
from megacore.progress import plural

app = make_app("Checkpoint artifact (any layout) to a Hugging Face model directory.")


@app.command()
def export(
    checkpoint: Path = typer.Argument(
        ..., metavar="CHECKPOINT", help="Checkpoint artifact, in any tp/pp/dp layout."
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Hugging Face model directory to write."),
    dtype: Literal["float32", "bfloat16", "float16"] | None = typer.Option(
        None, "--dtype", help="Weight dtype of the export (default: the checkpoint's)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is an export these tools wrote from other inputs."
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

    s = export_hf(checkpoint, out, dtype=dtype, force=force)
    if as_json:
        typer.echo(json.dumps(s, indent=2))
    elif s["reused"]:
        print(f"mega-export: {out} is already this export; reused (pass --force to rebuild)", file=sys.stderr)
    else:
        typer.echo(
            f"wrote {out}: {s['family']}, {plural(s['tensors'], 'tensor')} in {plural(len(s['files']), 'file')}, {s['dtype']}"
        )


main = main_for(app, "mega-export")
