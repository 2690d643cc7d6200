"""mega-train command line: parse, call the library, report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from mega_train import __version__
from megacore.cli import Verify, debug_option, error, main_for, make_app, verify_option, version_option
from megacore.progress import plural

app = make_app("3D-parallel pretraining and fine-tuning from a run manifest, under torchrun.")


@app.command()
def train(
    manifest: Path = typer.Option(..., "--manifest", "-m", help="The run manifest (run.json)."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check the manifest and its artifacts, print the plan."
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        show_default=False,
        help="Processes to plan for  [default: $WORLD_SIZE (set by torchrun), else 1]",
    ),
    verify: Verify = verify_option("the referenced artifacts' files"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout."),
    version: bool = version_option("mega-train", __version__),
    debug: bool = debug_option(),
) -> None:
    """Train from a run manifest (the training loop is not in this version yet: --dry-run checks a
    manifest and every artifact it references, and prints the resolved 3D plan).

    Example: mega-train --manifest run.json --dry-run --world-size 8
    """
    from mega_train.plan import plan_run

    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_run(manifest, ws, verify)
    summary = plan.summary()
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        par, batch = summary["parallel"], summary["batch"]
        typer.echo(
            f"{manifest}: ok — {summary['model']['family']} {summary['model']['layers']} layers; "
            f"world {par['world_size']} = tp {par['tp']} x pp {par['pp']} x dp {par['dp']}; "
            f"batch {batch['global']} = micro {batch['micro']} x dp {par['dp']} x accum {batch['grad_accum']}; "
            f"{plural(len(summary['data']), 'data source')}"
        )
    if not dry_run:
        error("mega-train", "training is not in this version yet; use --dry-run to check a manifest")
        raise typer.Exit(1)


main = main_for(app, "mega-train")
