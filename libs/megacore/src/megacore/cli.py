"""What every tool's `cli.py` shares: the typer app shape, `--version`, `--debug`, signals and the
exit codes (docs/architecture.md, "Errors").

Exit codes: 0 done, 1 failure while working, 2 bad input or usage, 130 interrupted (Ctrl-C), 143
terminated (SIGTERM, as Airflow and SLURM send). A bad input is one line on stderr; a traceback only
with `--debug` (anywhere on the command line) or `MEGA_DEBUG=1`. Interrupted or terminated, a tool
unwinds like on any failure: its staging directory is removed (megacore.artifacts.output).

A quiet console: what the libraries underneath print that says nothing about the work (their
warnings, log lines and progress bars, named below) is silenced where it is made, by
`quiet_libraries`, unless `--debug` or `MEGA_DEBUG=1` asks to see everything.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Literal

import typer
from typer.core import TyperCommand
from typer.exceptions import TyperException

from megacore import env
from megacore.errors import Silent, UserError
from megacore.signals import ARMED, RECEIVED, Stopped, raise_stopped, reset

Verify = Literal["sha256", "size", "none"]


class Command(TyperCommand):
    """Usage lines as in man pages, `mega-shard [OPTIONS] CHECKPOINT OUT`: typer would write
    `{CHECKPOINT} {OUT}`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


class App(typer.Typer):
    """typer.Typer whose commands are `Command`s."""

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)


def make_app(help: str) -> typer.Typer:
    """A typer app with the project's settings. A tool with one command gets it as its main
    command (`mega-shard CKPT OUT --tp 2`); add `version_option` to that command's parameters.
    A tool with subcommands (mega-convert) calls `add_group_options` instead."""
    return App(
        help=help,
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def version_option(prog: str, version: str):
    """`--version` for a command's signature: `version: bool = version_option("mega-x", __version__)`."""

    def show(value: bool) -> None:
        if value:
            typer.echo(f"{prog} {version}")
            raise typer.Exit()

    return typer.Option(False, "--version", callback=show, is_eager=True, help="Print the version and exit.")


def debug_option():
    """`--debug` in a command's help; `run` takes it out of the arguments wherever it stands."""
    return typer.Option(
        False,
        "--debug",
        help="Show the traceback on errors, and the libraries' warnings (or set MEGA_DEBUG=1).",
    )


def verify_option(what: str):
    """`--verify sha256|size|none` for a command's signature (typed `Verify`, default size): how the
    data files of `what` are checked before the command starts. sha256 reads every byte; size is
    instant on terabytes of shards. A reader of checkpoint tensors hashes each file it opens anyway
    (artifacts/tensors.py), unless this already did."""
    return typer.Option("size", "--verify", help=f"How to check {what} first.")


def add_group_options(app: typer.Typer, prog: str, version: str) -> None:
    """`--version` and `--debug` on a tool with subcommands."""

    @app.callback()
    def _root(
        _version: bool = version_option(prog, version),
        _debug: bool = debug_option(),
    ) -> None:
        pass


def error(prog: str, message: str) -> None:
    """One line on stderr, the way every tool reports a problem."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def _stopped(prog: str, signum: int, quiet: bool = False) -> int:
    if not quiet:
        error(prog, "interrupted" if signum == signal.SIGINT else "terminated")
    return 128 + signum


def split_debug(args: list[str]) -> tuple[list[str], bool]:
    """The arguments without `--debug` (anywhere before a `--` separator), and whether it was there
    or `MEGA_DEBUG=1` is set."""
    end = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:end] or env.flag("MEGA_DEBUG")
    return [a for i, a in enumerate(args) if not (a == "--debug" and i < end)], debug


# The libraries' loggers whose warnings are about nothing a tool does, to errors only: torchao,
# which transformers' quantizer registry imports whenever it is installed, logs that its C++/CUDA
# kernels did not load (the float8 training it serves us is Python); torch's pytree logs the
# deprecation of what torchao registers; lm-eval its own bookkeeping (a task's metric without an
# aggregation, which it defaults; `--limit` being for tests).
FOREIGN_LOGGERS = ("torchao", "torch.utils._pytree", "lm_eval")
# Python warnings, by category and the start of their message: DTensor's, once per rank, at LoRA's
# adapter dropout under tp on a CPU mesh, where DTensor keeps no RNG tracker: each rank draws the
# masks from its own generator, seeded and drawn from alike, so a replicated input's masks agree
# as the tracker makes them on a GPU.
FOREIGN_WARNINGS = ((UserWarning, "DTensor random operators may not have complete support"),)
# Switches the libraries read when they are imported: tqdm's bars (lm-eval's, a bar per task and
# request type) and datasets' (lm-eval's task data) off; lm-eval's command line logs errors only.
QUIET_VARIABLES = (
    ("TQDM_DISABLE", "1"),
    ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
    ("LMEVAL_LOG_LEVEL", "ERROR"),
)
_QUIET = [False]
_DEBUG = [False]


def quiet_libraries() -> Callable[[], None]:
    """Silence the libraries' warnings, log lines and progress bars named above, in this process and
    those it starts (they inherit the variables; one already set is left as it is); returns what
    puts it all back (`run` calls it when its command ends, as it puts the signal handlers back: a
    process that goes on, a test's, is left as it was). Call it before torch is imported: torch
    imports tqdm, which reads its switch then. Our own lines and every error still show."""
    undo = contextlib.ExitStack()
    undo.enter_context(warnings.catch_warnings())
    for category, message in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name in FOREIGN_LOGGERS:
        logger = logging.getLogger(name)
        undo.callback(logger.setLevel, logger.level)
        logger.setLevel(logging.ERROR)
    for name, value in QUIET_VARIABLES:
        if env.set_for_libraries(name, value):
            undo.callback(env.unset, name)
    _QUIET[0] = True
    undo.callback(_QUIET.__setitem__, 0, False)
    return undo.close


def quieted() -> bool:
    """Whether `quiet_libraries` ran in this process (a bar the libraries draw whatever their
    switches, such as lm-eval's tokenizing one, is then turned off by its caller)."""
    return _QUIET[0]


def debugging() -> bool:
    """Whether the running command was given `--debug` (or `MEGA_DEBUG=1`), which `run` takes out of
    its arguments: the processes it starts get it too (mega-train's workers)."""
    return _DEBUG[0]


def run(
    app: typer.Typer | Callable[..., object],
    prog: str,
    argv: list[str] | None = None,
    quiet_stop: bool = False,
) -> int:
    """Run a typer app with the project's exit-code and error-line conventions; returns the exit code.
    `quiet_stop`: a signal ends the process with its exit code and no line (a torchrun worker but
    rank 0, which says it once: torchrun stops every worker when one fails)."""
    args, debug = split_debug(list(sys.argv[1:] if argv is None else argv))
    command = typer.main.get_command(app) if isinstance(app, typer.Typer) else app
    previous = {}
    loud = None  # what undoes the quiet console
    reset()  # the signals of an earlier run in this process forgotten
    if argv is None:  # a console-script run owns the process, its signals and its console
        previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
        if not debug:
            loud = quiet_libraries()
    ARMED[0], _DEBUG[0] = True, debug
    try:
        result = command.main(args=args, prog_name=prog, standalone_mode=False)
        ARMED[0] = False
        return int(result) if isinstance(result, int) else 0
    except BaseException as e:
        # First, before any call (where Python runs a pending handler): disarm.
        ARMED[0] = False
        return _exit_code(e, prog, debug, quiet_stop)
    finally:
        ARMED[0] = _DEBUG[0] = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if loud is not None:
            loud()


def _exit_code(e: BaseException, prog: str, debug: bool, quiet_stop: bool) -> int:
    """How a command that raised `e` ends: its line on stderr (if any) and its exit code."""
    if isinstance(e, typer.Exit):
        return e.exit_code
    if isinstance(e, typer.Abort):
        error(prog, "aborted")
        return 1
    if isinstance(e, TyperException):
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # prints the help text
            return 2
        # Usage errors: the one line click would print, without its multi-line banner.
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        error(prog, message.replace("Value error, ", ""))
        return 2
    if isinstance(e, Stopped):
        return _stopped(prog, e.signum, quiet_stop)
    if not isinstance(e, Exception):  # SystemExit, KeyboardInterrupt: as Python would
        raise e
    if RECEIVED and not isinstance(e, Silent):  # the stop, reported by a library as another error
        return _stopped(prog, RECEIVED[0], quiet_stop)
    if debug:
        traceback.print_exception(e)
    if isinstance(e, UserError):
        if not isinstance(e, Silent):
            error(prog, str(e))
        return e.exit_code
    error(prog, f"{type(e).__name__}: {e} (rerun with --debug for the traceback)")
    return 1


def main_for(app: typer.Typer, prog: str, quiet_stop: Callable[[], bool] | None = None) -> Callable[[], None]:
    """The console-script entry point: `main = main_for(app, "mega-x")`; `quiet_stop` (asked at
    start) as `run`'s."""

    def main() -> None:
        sys.exit(run(app, prog, quiet_stop=quiet_stop() if quiet_stop is not None else False))

    return main
