"""mega-train command line: parse, call the library, report."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import typer

from mega_train import __version__
from megacore.cli import Verify, debug_option, main_for, make_app, verify_option, version_option
from megacore.errors import Silent, UserError
from megacore.progress import plural

app = make_app("3D-parallel pretraining and fine-tuning from a run manifest, under torchrun.")


@app.command()
def train(
    manifest: Path = typer.Option(..., "--manifest", "-m", help="The run manifest (run.json)."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the manifest and its artifacts, print the plan and each rank's memory, train nothing.",
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        show_default=False,
        help="Processes to plan for  [default: $WORLD_SIZE (set by torchrun), else 1]",
    ),
    peak_tflops: float | None = typer.Option(
        None,
        "--peak-tflops",
        show_default=False,
        help="Peak TFLOP/s of one device, for MFU  [default: a table of known GPUs; none on CPU]",
    ),
    gpus: int | None = typer.Option(
        None,
        "--gpus",
        min=1,
        show_default=False,
        help="With --dry-run: plan for this many GPUs (the world size) and rank every tp x pp x dp "
        "layout of them that fits --gpu-memory by expected throughput.",
    ),
    gpu_memory: str | None = typer.Option(
        None,
        "--gpu-memory",
        metavar="<size>",
        show_default=False,
        help="With --dry-run: the memory of one GPU, e.g. 80GB (binary units: 80GB = 80 GiB, what "
        "nvidia-smi shows as 81920MiB); says whether each rank fits.",
    ),
    verify: Verify = verify_option("the referenced artifacts' files"),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print a machine-readable summary on stdout: the plan (with --dry-run), else the run's "
        "newest checkpoint (`out`), step, losses; the console lines go to stderr.",
    ),
    version: bool = version_option("mega-train", __version__),
    debug: bool = debug_option(),
) -> None:
    """Train from a run manifest, in one process or under torchrun (one process per device).

    Checkpoints go to the run's `out` directory; rerunning the same command resumes from the newest
    complete one (in any tp/pp/dp layout). SIGTERM or SIGUSR1 saves a checkpoint and exits 0.
    With --json, rank 0 ends by printing the run's summary on stdout, `out` being the newest
    checkpoint: what an orchestrator hands to mega-export.

    Example: torchrun --nproc-per-node 8 $(which mega-train) --manifest run.json
    """
    from mega_train.plan import check_machine, plan_run
    from megacore.parallel.memory import parse_size

    # Planning flags are checked before the manifest: a typo fails at once.
    memory_bytes = parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    if (gpus is not None or gpu_memory is not None) and not dry_run:
        raise UserError(
            "--gpus and --gpu-memory plan a run: add --dry-run (torchrun sets a run's world size)"
        )
    if gpus is not None:
        if world_size is not None:
            raise UserError("give --gpus or --world-size, not both", "--gpus")
        if memory_bytes is None:
            raise UserError("ranking layouts needs --gpu-memory, e.g. --gpu-memory 80GB", "--gpus")
        world_size = gpus
    rank = int(os.environ.get("RANK", "0"))
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plan = plan_run(manifest, ws, verify)
        if not dry_run:
            check_machine(plan)
    except UserError as e:
        if rank == 0:
            raise
        # Every rank finds the same; rank 0 says it once. Torchrun stops the others (SIGTERM) as
        # soon as one exits, so the silent ones give rank 0 a moment to print, and go quietly.
        code = e.exit_code
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(2)
        raise Silent(code) from None
    if dry_run or rank == 0:
        summary = plan.summary()
        report = None
        if dry_run:
            from mega_train.planner import memory_lines, memory_plan

            report = memory_plan(plan, memory_bytes, gpus)
            summary |= report
        if as_json and dry_run:
            typer.echo(json.dumps(summary, indent=2))
        else:
            par, batch = summary["parallel"], summary["batch"]
            typer.echo(
                f"{manifest}: ok — {summary['model']['family']} {summary['model']['layers']} layers; "
                f"world {par['world_size']} = tp {par['tp']} x pp {par['pp']} x dp {par['dp']}; "
                f"batch {batch['global']} = micro {batch['micro']} x dp {par['dp']} x accum {batch['grad_accum']}; "
                f"{plural(len(summary['data']), 'data source')}; {plan.run.train_steps} steps",
                err=as_json,
            )
            if report is not None:
                typer.echo("\n".join(memory_lines(report)))
    if dry_run:
        return
    if world_size is not None and world_size != int(os.environ.get("WORLD_SIZE", "1")):
        raise UserError("--world-size is for --dry-run; a run's world size is torchrun's", "--world-size")
    from mega_train.train import train as run_training

    if not as_json:
        run_training(plan, peak_tflops)
        return
    # stdout carries the summary alone: everything the run prints goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        finished = run_training(plan, peak_tflops)
    if finished is not None:
        typer.echo(json.dumps(finished, indent=2))


main = main_for(app, "mega-train")
