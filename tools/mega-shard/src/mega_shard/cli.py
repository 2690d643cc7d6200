"""mega-shard command line: parse, call the library, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mega_shard import __version__
from megacore.cli import Verify, debug_option, main_for, make_app, verify_option, version_option
from megacore.errors import UserError
from megacore.progress import plural

if TYPE_CHECKING:
    from mega_shard.reshard import ShardResult  # imported when run, so --help stays instant

app = make_app("Reshard a checkpoint artifact to any tensor/pipeline layout, streaming, no GPU.")


def _counts(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise UserError(
            f"expected comma-separated layer counts such as 10,10,12,8, got {value!r}", "--pp-layers"
        ) from None


@app.command()
def run(
    checkpoint: Path = typer.Argument(
        ..., metavar="CHECKPOINT", help="Input checkpoint artifact (any layout)."
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Output checkpoint artifact directory."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size of the output."),
    pp: int = typer.Option(1, "--pp", help="Pipeline stages of the output."),
    pp_layers: str | None = typer.Option(
        None, "--pp-layers", help="Layers per stage, comma-separated (default: an even split)."
    ),
    ep: int = typer.Option(
        1,
        "--ep",
        help="Expert-parallel size of the output: a mixture of experts' experts split into ep files.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is a checkpoint these tools wrote from other inputs."
    ),
    verify: Verify = verify_option("the input's files"),
    chunk_mb: int = typer.Option(64, "--chunk-mb", help="Streaming block size (MiB)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
    version: bool = version_option("mega-shard", __version__),
    debug: bool = debug_option(),
) -> None:
    """Reshard CHECKPOINT into OUT with the given layout (optimizer state included).

    \b
    Example:
      mega-shard ckpt-tp1pp1 ckpt-tp8pp4 --tp 8 --pp 4 --pp-layers 10,10,6,6
      mega-shard mixtral-ckpt mixtral-ep8tp2 --tp 2 --ep 8
    """
    if chunk_mb < 1:
        raise UserError(f"must be at least 1, got {chunk_mb}", "--chunk-mb")
    from mega_shard.reshard import reshard  # imports torch; keep --help and --version instant

    res = reshard(
        checkpoint,
        out,
        tp,
        pp,
        _counts(pp_layers),
        ep=ep,
        force=force,
        verify=verify,
        chunk_bytes=chunk_mb << 20,
        producer=("mega-shard", __version__),
    )
    _report(res, as_json)


def _report(res: ShardResult, as_json: bool) -> None:
    """The --json summary on stdout, or what was written on stderr (nothing when reused: the
    library said so)."""
    summary = {
        "out": res.out,
        "tp": res.tp,
        "pp": res.pp,
        "ep": res.ep,
        "stage_layers": res.stage_layers,
        "reused": res.reused,
        "tensors": res.tensors,
        "files": res.files,
        "bytes_written": res.bytes_written,
        "seconds": round(res.seconds, 3),
    }
    if as_json:
        typer.echo(json.dumps(summary))
    elif not res.reused:
        layout = f"tp {res.tp}, pp {res.pp}{f', ep {res.ep}' if res.ep > 1 else ''}"
        typer.echo(
            f"mega-shard: wrote {res.out} ({layout}; {plural(res.tensors, 'tensor')}, {plural(len(res.files), 'file')}, "
            f"{res.bytes_written / 1e9:.2f} GB in {res.seconds:.1f}s)",
            err=True,
        )


main = main_for(app, "mega-shard")
