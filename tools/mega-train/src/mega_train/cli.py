"""mega-train command line: parse, call the library, report."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import typer

from mega_train import __version__
from megacore import env
from megacore.cli import Verify, debug_option, debugging, main_for, make_app, verify_option, version_option
from megacore.errors import Silent, UserError
from megacore.progress import plural

app = make_app("3D-parallel pretraining and fine-tuning from a run manifest, under torchrun.")


# The options with long help, declared apart so that `train` reads as what it does.
DRY_RUN = typer.Option(
    False,
    "--dry-run",
    help="Check the manifest and its artifacts, print the plan and each rank's memory, train nothing.",
)
WORLD_SIZE = typer.Option(
    None,
    "--world-size",
    show_default=False,
    help="Processes to plan for  [default: $WORLD_SIZE (set by torchrun), else 1]",
)
PEAK_TFLOPS = typer.Option(
    None,
    "--peak-tflops",
    show_default=False,
    help="Peak TFLOP/s of one device, for MFU  [default: a table of known GPUs; none on CPU]",
)
GPUS = typer.Option(
    None,
    "--gpus",
    min=1,
    show_default=False,
    help="With --dry-run: plan for this many GPUs (the world size), rank every tp x pp x cp x dp "
    "layout of them that fits --gpu-memory by expected throughput, and name the longest sequence "
    "each fits.",
)
GPU_MEMORY = typer.Option(
    None,
    "--gpu-memory",
    metavar="<size>",
    show_default=False,
    help="With --dry-run: the memory of one GPU, e.g. 80GB (binary units: 80GB = 80 GiB, what "
    "nvidia-smi shows as 81920MiB); says whether each rank fits.",
)
AS_JSON = typer.Option(
    False,
    "--json",
    help="Print a machine-readable summary on stdout: the plan (with --dry-run), else the run's "
    "newest checkpoint (`out`), step, losses; the console lines go to stderr.",
)
NPROC_PER_NODE = typer.Option(
    None,
    "--nproc-per-node",
    min=1,
    show_default=False,
    help="Launch the workers of this node itself, as torchrun would, with clean stops: SIGTERM, "
    "Ctrl-C or SIGUSR1 save a checkpoint and exit 0 (see README, Stopping a run).",
)


@app.command()
def train(
    manifest: Path = typer.Option(..., "--manifest", "-m", help="The run manifest (run.json)."),
    dry_run: bool = DRY_RUN,
    world_size: int | None = WORLD_SIZE,
    peak_tflops: float | None = PEAK_TFLOPS,
    gpus: int | None = GPUS,
    gpu_memory: str | None = GPU_MEMORY,
    verify: Verify = verify_option("the referenced artifacts' files"),
    as_json: bool = AS_JSON,
    nproc_per_node: int | None = NPROC_PER_NODE,
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="With --nproc-per-node: the number of nodes."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="With --nproc-per-node: this node's rank."),
    master_addr: str | None = typer.Option(
        None, "--master-addr", show_default=False, help="With --nproc-per-node: node 0's address."
    ),
    master_port: int | None = typer.Option(
        None, "--master-port", show_default=False, help="With --nproc-per-node: node 0's port."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        min=0,
        help="With --nproc-per-node: start the workers again, up to N times, "
        "when one fails (they resume from the newest intact checkpoint).",
    ),
    version: bool = version_option("mega-train", __version__),
    debug: bool = debug_option(),
) -> None:
    """Train from a run manifest, in one process, under torchrun, or with --nproc-per-node.

    Checkpoints go to the run's `out` directory; rerunning the same command resumes from the newest
    intact one (in any tp/pp/dp layout). SIGTERM, SIGINT or SIGUSR1 saves a checkpoint and exits 0.
    With --json, rank 0 ends by printing the run's summary on stdout, `out` being the newest
    checkpoint: what an orchestrator hands to mega-export.

    Example: mega-train --nproc-per-node 8 --manifest run.json
    """
    memory_bytes = _planning_flags(dry_run, gpus, gpu_memory, world_size, nproc_per_node)
    if gpus is not None:
        world_size = gpus
    launcher = nproc_per_node is not None
    if launcher:
        world_size = nproc_per_node * nnodes
    plan = _plan(manifest, world_size, verify, machine=gpus is None)
    if dry_run or not launcher:  # a launcher's rank 0 worker says it
        _report(plan, dry_run, as_json, memory_bytes, gpus, verify)
    if dry_run:
        return
    if launcher:
        from mega_train.launch import launch, torchrun_args

        worker = ["--manifest", str(manifest), "--verify", verify]
        worker += (["--json"] if as_json else []) + (["--debug"] if debugging() else [])
        worker += ["--peak-tflops", str(peak_tflops)] if peak_tflops is not None else []
        options = torchrun_args(nproc_per_node, nnodes, node_rank, master_addr, master_port, max_restarts)
        raise typer.Exit(launch(options, worker))
    if world_size is not None and world_size != int(env.get("WORLD_SIZE", "1")):
        raise UserError("--world-size is for --dry-run; a run's world size is torchrun's", "--world-size")
    _train(plan, peak_tflops, as_json)


def _train(plan, peak_tflops: float | None, as_json: bool) -> None:
    """Run the training on this rank, with the faults a test asks for (`faults.py`); with --json
    stdout carries the summary alone: everything the run prints goes to stderr."""
    from mega_train.faults import ENV, Faults
    from mega_train.trainer import train as run_training

    start = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    faults = Faults.parse(env.get(ENV), int(env.get("RANK", "0")), int(start))
    if not as_json:
        run_training(plan, peak_tflops, faults)
        return
    with contextlib.redirect_stdout(sys.stderr):
        finished = run_training(plan, peak_tflops, faults)
    if finished is not None:
        typer.echo(json.dumps(finished, indent=2))


def _planning_flags(
    dry_run: bool, gpus: int | None, gpu_memory: str | None, world_size: int | None, nproc: int | None
) -> int | None:
    """Check the flags that only plan (before the manifest: a typo fails at once); returns
    --gpu-memory in bytes."""
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
    if nproc is not None and (world_size is not None or gpus is not None):
        raise UserError("--nproc-per-node sets the world size: give it without --world-size or --gpus")
    if nproc is not None and env.get("RANK") is not None:
        raise UserError("--nproc-per-node launches the workers: run mega-train with it, not under torchrun")
    return memory_bytes


def _plan(manifest: Path, world_size: int | None, verify: Verify, machine: bool):
    """The checked plan and the start-up checks (the same for a dry run and a run); every rank
    finds the same, and rank 0 says it once."""
    from mega_train.run_plan import plan_run, start_checks

    rank = int(env.get("RANK", "0"))
    ws = world_size if world_size is not None else int(env.get("WORLD_SIZE", "1"))
    try:
        plan = plan_run(manifest, ws, verify)
        start_checks(plan, machine)
    except UserError as e:
        if rank == 0:
            raise
        # Torchrun stops the others (SIGTERM) as soon as one exits, so the silent ones wait for
        # rank 0 to print and exit (however loaded the machine), and go quietly.
        code = e.exit_code
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(30)
        raise Silent(code) from None
    return plan


def _report(
    plan, dry_run: bool, as_json: bool, memory_bytes: int | None, gpus: int | None, verify: Verify
) -> None:
    """The plan's line (and with --dry-run each rank's memory and where it would resume), on rank 0."""
    if not (dry_run or int(env.get("RANK", "0")) == 0):
        return
    summary = plan.summary()
    notes = list(plan.notes) + _limit_note(plan.run.eval)
    report = None
    if dry_run:
        from mega_train.memory_plan import memory_lines, memory_plan

        compile_note = plan.compile_note(this_machine=gpus is None)
        resume, step = plan.resume_notes(verify)
        notes += ([compile_note] if compile_note else []) + resume
        report = memory_plan(plan, memory_bytes, gpus)
        # Whether a start now would have anything to do: a job script's test (examples/kubernetes).
        summary |= report | {"notes": notes, "resumes_at": step, "complete": step >= plan.run.train_steps}
    if as_json and dry_run:
        typer.echo(json.dumps(summary, indent=2))
        return
    par, batch = summary["parallel"], summary["batch"]
    model = summary["model"]
    active = model["active_parameters"]
    sizes = f"{_count(model['parameters'])} parameters" + (
        f", {_count(active)} active per token" if active != model["parameters"] else ""
    )
    if summary["lora"] is not None:  # what the run trains, and how its base is held
        nf4 = " on an NF4 base" if summary["lora"]["base_dtype"] == "nf4" else ""
        sizes += f", {_count(model['trained_parameters'])} trained in LoRA adapters{nf4}"
    typer.echo(
        f"{plan.path}: ok — {model['family']} {model['layers']} layers ({sizes}); "
        f"world {par['world_size']} = {plan.dims.label}; "
        f"batch {batch['global']}{_batch_unit(summary['sample_unit'], batch['rows_per_sample'])} = "
        f"micro {batch['micro']} x "
        f"dp {par['dp']} x accum {batch['grad_accum']}; "
        f"{plural(len(summary['data']), 'data source')}; {plural(plan.run.train_steps, 'step')}"
        + (f"; objective {summary['objective']}" if summary["objective"] != "lm" else ""),
        err=as_json,
    )
    for note in notes:
        typer.echo(f"mega-train: {note}", err=as_json)
    if report is not None:
        typer.echo("\n".join(memory_lines(report)))


def _limit_note(spec) -> list[str]:
    """lm-eval's warning that a limited evaluation is not the benchmark's score, said once in our
    words (lm-eval's own log lines are silenced: megacore.cli.quiet_libraries)."""
    if not spec.tasks or spec.limit is None:
        return []
    return [
        f"eval.limit: lm-eval's tasks are scored on their first {spec.limit} documents, not whole benchmarks"
    ]


def _batch_unit(unit: str, rows_per_sample: int) -> str:
    """What the batch sizes count where they are not sequences: pairs, rows of packed pairs, or
    prompts with their completions."""
    if unit == "prompts":
        return f" prompts x {rows_per_sample} completions"
    return "" if unit == "sequences" else f" {unit}"


def _count(n: int) -> str:
    """46.7B, 125M, or the number itself."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"


# --gpu-memory: '80GB', '80G', '80GiB', '81920MiB' or '4096B'.
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str, where: str = "--gpu-memory") -> int:
    """Bytes from '80GB', '80G', '80GiB', '81920MiB' or '4096B'. Units are binary (80GB = 80 GiB), as
    GPU memory is sold and reported (nvidia-smi: 81920MiB on an 80 GB A100). A bare number is
    refused: `--gpu-memory 80` means 80 GB, never 80 bytes."""
    m = SIZE.match(text)
    if m is None:
        raise UserError(f"{text!r} is not a memory size such as 80GB or 81920MiB", where)
    if m.group(2) is None:
        raise UserError(f"{m.group(1)} has no unit: did you mean {m.group(1)}GB?", where)
    unit = m.group(2).lower()
    power = "bkmgt".index(unit[0])
    value = float(m.group(1)) * (1 << (10 * power))
    if value < 1:
        raise UserError(f"{text!r} is not a positive memory size", where)
    return int(value)


main = main_for(app, "mega-train", quiet_stop=lambda: int(env.get("RANK", "0")) > 0)
