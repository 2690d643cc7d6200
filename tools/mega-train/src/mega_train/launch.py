"""`mega-train --nproc-per-node N`: torchrun's launcher (`torch.distributed.run`'s API, the same
elastic agent and rendezvous) with the stopping a scheduler expects.

What it changes from plain `torchrun`:

- SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to the launcher are forwarded to its workers, which save one
  checkpoint at the next step boundary and exit 0; the launcher then exits 0, with the one line of
  rank 0 and no traceback. It never kills a worker that is saving (plain torchrun does after its
  `--shutdown-timeout`, 30 s). A second Ctrl-C is forwarded too, and aborts at once (exit 130).
- A worker that fails makes the launcher exit with that worker's code (2 for bad input, whose one
  line the worker printed), without torchrun's `ChildFailedError` report; of several, the one that
  failed first: a worker killed by a signal (SIGKILL) before those whose collectives then failed.
- A stop that comes before the workers can save (before any is started, or while they start) ends
  the launch with one line (rank 0's, or this launcher's) and the signal's exit code.
- The manifest is checked here before any worker starts, so a bad one is one line, once.
- The workers watch the launcher: if it is SIGKILLed they exit within a second (`lifecycle.py`).
- With `--max-restarts N` a failed worker makes the agent start all workers again (each start
  meets in a store prefix of its own: `megacore.parallel.mesh`), said in one line per restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

from megacore import env
from megacore.cli import error

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def children(pid: int) -> list[int]:
    """The child processes of `pid` (a launcher's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


_FORWARDED: list[int] = []  # the stop signals forwarded to the workers


def _forward(previous: dict[int, Callable | int], signum: int, frame: object) -> None:
    """Forward a stop to the workers; with none started yet, stop this launcher as its command
    line's handler would (`megacore.cli`: one line, the signal's exit code)."""
    workers = children(os.getpid())
    if not workers and not _FORWARDED and callable(previous.get(signum)):
        previous[signum](signum, frame)
        return
    _FORWARDED.append(signum)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _failure(failures: dict) -> int:
    """The launcher's exit code for workers that failed (module docstring), and its line where the
    workers said none."""
    if _FORWARDED and all(
        _stopped(f.exitcode) or f.exitcode == 128 + signal.SIGINT for f in failures.values()
    ):
        # Stopped while starting, before a checkpoint could be saved. Rank 0 said so in one line
        # if it handled the signal (its code: 143, 130); one still starting (no handler yet, or
        # SIGUSR1's) was ended by it without a word, and this launcher says it.
        rank0 = failures.get(0)
        if rank0 is None or rank0.exitcode < 0:
            error("mega-train", f"{signal.Signals(_FORWARDED[0]).name} before the first step: nothing saved")
        return 128 + _FORWARDED[0]
    # The root cause: a rank killed by a signal from outside the job (SIGKILL, SIGSEGV: its peers
    # then fail on their collectives, exit 1), else the first rank that exited by itself (the agent
    # SIGTERMs the others then, which end with 143). The agent's timestamps are whole seconds of
    # when it looked, which orders neither.
    rank, failure = min(failures.items(), key=lambda kv: (_cause(kv[1].exitcode), kv[1].timestamp))
    code = failure.exitcode
    if code < 0:  # killed by a signal: report it as a shell would
        error("mega-train", f"rank {rank} was killed by {signal.Signals(-code).name}")
        return 128 - code
    if code != 2:  # a bad input's one line was printed by the worker itself
        error("mega-train", f"rank {rank} exited with code {code}")
    return code


class _Restarts(logging.Handler):
    """One line where the agent starts the workers again (`--max-restarts`), counted: a restart
    that itself fails shows as one more."""

    def emit(self, record: logging.LogRecord) -> None:
        if "attempts left" in str(record.msg):
            left, total = record.args[2], record.args[3]
            print(
                f"mega-train: a worker failed; the workers start again (restart {total - left + 1} of "
                f"{total}) and resume from the newest checkpoint",
                file=sys.stderr,
                flush=True,
            )


def _stopped(exitcode: int) -> bool:
    """Whether a worker ended by a signal (killed, or its own exit on SIGTERM)."""
    return exitcode < 0 or exitcode == 128 + signal.SIGTERM


def _cause(exitcode: int) -> int:
    """How likely a worker's end is the job's failure, not a consequence of it (lowest first): killed
    by a signal the agent does not send (a worker stopped by SIGTERM exits within `STUCK_S`, long
    before the agent's SIGKILL), exited by itself, stopped."""
    if exitcode < 0 and exitcode != -signal.SIGTERM:
        return 0
    return 2 if _stopped(exitcode) else 1


def torchrun_args(
    nproc: int,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun options of a static rendezvous (on one node without an address, torchrun's
    `--standalone`: a c10d rendezvous on a free local port), restarting the workers up to
    `max_restarts` times."""
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--node-rank={node_rank}"]
    args.append(f"--max-restarts={max_restarts}")
    if nnodes == 1 and master_addr is None and master_port is None:
        return [*args, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    args.append(f"--master-addr={master_addr or '127.0.0.1'}")
    if master_port is not None:
        args.append(f"--master-port={master_port}")
    return args


def launch(options: list[str], worker_args: list[str]) -> int:
    """Run `mega-train <worker_args>` in each worker under torchrun's elastic agent started with
    `options`; returns the launcher's exit code (module docstring)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    env.set_for_libraries("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
    # The agent's own log lines (a worker's exit code, closing processes) repeat what the workers
    # and this launcher say in one line.
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent.setLevel(logging.INFO)  # its restarts, said in our words (`_Restarts`)
    agent.propagate = False
    if not any(isinstance(h, _Restarts) for h in agent.handlers):
        agent.addHandler(_Restarts())
    entry = [sys.executable, "-c", "from mega_train.cli import main; main()"]
    args = get_args_parser().parse_args([*options, "--no-python", *entry, *worker_args])
    config, cmd, cmd_args = config_from_args(args)
    # The agent handles only what we do not: the stop signals are ours to forward.
    config.signals_to_handle = "SIGHUP,SIGQUIT"
    previous: dict[int, Callable | int] = {}
    previous.update({s: signal.signal(s, partial(_forward, previous)) for s in FORWARDED})
    _FORWARDED.clear()
    try:
        elastic_launch(config, cmd)(*cmd_args)
        return 0
    except ChildFailedError as e:
        return _failure(e.failures)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
