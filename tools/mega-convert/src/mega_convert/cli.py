"""mega-convert command line: parse, call the library, report."""

from __future__ import annotations

from pathlib import Path

import typer

from megacore.cli import add_group_options, main_for, make_app
from megacore.errors import UserError
from mega_convert import __version__

app = make_app("Hugging Face Llama / Code Llama / Mistral / Falcon weights to a checkpoint artifact.")
add_group_options(app, "mega-convert", __version__)


@app.command()
def hf(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)."),
    out: Path = typer.Argument(..., help="Output checkpoint artifact directory."),
) -> None:
    """Convert a Hugging Face model directory to a tp1/pp1 checkpoint artifact."""
    raise UserError("not implemented in this version yet")


main = main_for(app, "mega-convert")
