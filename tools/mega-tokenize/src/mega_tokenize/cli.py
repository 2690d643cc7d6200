"""mega-tokenize command line: parse, call the library, report."""

from __future__ import annotations

from pathlib import Path

import typer

from megacore.cli import debug_option, main_for, make_app, version_option
from megacore.errors import UserError
from mega_tokenize import __version__

app = make_app("Text corpora (jsonl, .zst, .gz) to Megatron-compatible token shards.")


@app.command()
def run(
    src: Path = typer.Argument(..., help="Input."), out: Path = typer.Argument(..., help="Output artifact."),
    version: bool = version_option("mega-tokenize", __version__),
    debug: bool = debug_option(),
) -> None:
    """Not available in this version yet."""
    raise UserError("not implemented in this version yet")


main = main_for(app, "mega-tokenize")
