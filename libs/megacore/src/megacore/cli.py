"""What every tool's `cli.py` shares: the typer app shape, `--version`, `--debug` and the exit codes.

Exit codes (DESIGN.md section 5): 0 done, 1 failure while working, 2 bad input or usage. A bad
input is one line on stderr; a traceback only with `--debug`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import typer
from typer.exceptions import TyperException

from megacore.errors import UserError


def make_app(help: str) -> typer.Typer:
    """A typer app with the project's settings. A tool with one command gets it as its main
    command (`mega-shard CKPT OUT --tp 2`); add `version_option` to that command's parameters.
    A tool with subcommands (mega-convert) calls `add_group_options` instead."""
    return typer.Typer(
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
    """`--debug` for a command's signature; `run` reads it from argv so it works anywhere."""
    return typer.Option(False, "--debug", help="Show the traceback on errors.")


def verify_option(what: str):
    """`--verify sha256|size|none` for a command's signature (default size): how the data files of
    `what` are checked before use. sha256 reads every byte; size is instant on terabytes of shards."""

    def check(value: str) -> str:
        if value not in ("sha256", "size", "none"):
            raise UserError(f"expected sha256, size or none, got {value!r}", "--verify")
        return value

    return typer.Option(
        "size", "--verify", callback=check, help=f"How to check {what} first: sha256, size or none."
    )


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


def run(app: typer.Typer | Callable[..., object], prog: str, argv: list[str] | None = None) -> int:
    """Run a typer app with the project's exit-code and error-line conventions; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("MEGA_DEBUG") == "1"
    command = typer.main.get_command(app) if isinstance(app, typer.Typer) else app
    try:
        result = command.main(args=args, prog_name=prog, standalone_mode=False)
        return int(result) if isinstance(result, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        error(prog, "aborted")
        return 1
    except TyperException as e:
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # prints the help text
            return 2
        # Usage errors: the one line click would print, without its multi-line banner.
        error(prog, e.format_message() if hasattr(e, "format_message") else str(e))
        return 2
    except UserError as e:
        if debug:
            traceback.print_exc()
        error(prog, str(e))
        return e.exit_code
    except KeyboardInterrupt:
        error(prog, "interrupted")
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        error(prog, f"{type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return 1


def main_for(app: typer.Typer, prog: str) -> Callable[[], None]:
    """The console-script entry point: `main = main_for(app, "mega-x")`."""

    def main() -> None:
        sys.exit(run(app, prog))

    return main
