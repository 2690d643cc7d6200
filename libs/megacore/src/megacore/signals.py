"""Stop signals (SIGINT, SIGTERM) in a tool's main thread: the handler `megacore.cli.run` installs
(`raise_stopped`), what it received, and `signals_held`, the blocks it raises after, not inside.

The handler raises `Stopped` where the main thread stands, so the tool unwinds (and cleans up) as
on any failure; only while the command runs (`ARMED`). Inside a `signals_held` block it records
the signal and the block raises it as it ends: around the main thread's waits on helper threads
(`megacore.background`), since a handler raising inside `threading`'s lock handling can leave a
lock released under the other thread or a wake-up lost, and both threads then wait forever.
mega-train's own handler, which sets a flag instead, counts itself with `mark_handled`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Stopped(BaseException):
    """SIGINT or SIGTERM, raised in the main thread so the tool unwinds (and cleans up) as on any
    failure. Not a KeyboardInterrupt: typer would turn that into a silent exit 130."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The signals received, if any: a library whose C code runs the handler may report the exception
# as its own (torch: "could not determine the shape of object type ..."), so the exit still says it.
RECEIVED: list[int] = []

# Whether the handler raises: only while the command runs. Once `run` handles how the command ended,
# a signal (torchrun SIGTERMs every worker when one exits) is recorded, not raised, or it would
# escape the handling as a traceback and exit 1.
ARMED = [False]

# Stop signals a Python handler has run for (this module's, or a tool's own that calls
# `mark_handled`): a watcher thread compares them with the signals received (mega_train.lifecycle).
_HANDLED = [0]

# How deep the main thread is in `signals_held` blocks, and the stop signals that arrived in one.
_HELD = [0]
_DEFERRED: list[int] = []


def mark_handled() -> None:
    """A Python-level handler ran for a stop signal (the main thread is not stuck in C code)."""
    _HANDLED[0] += 1


def handled_signals() -> int:
    return _HANDLED[0]


def reset() -> None:
    """Forget the signals of an earlier command run in this process."""
    RECEIVED.clear()
    _DEFERRED.clear()


def raise_stopped(signum: int, frame: object) -> None:
    """The tools' handler of SIGINT and SIGTERM."""
    RECEIVED.append(signum)
    mark_handled()
    if ARMED[0] and _HELD[0]:
        _DEFERRED.append(signum)
    elif ARMED[0]:
        raise Stopped(signum)


@contextmanager
def signals_held() -> Iterator[None]:
    """A stop signal arriving inside the block is raised (`Stopped`) as the block ends, not inside
    it (CI: mega-convert hung on Ctrl-C, joining a sink whose thread waited on an empty queue). A
    block that ends by an exception raises nothing more: the signal is on record for the exit code."""
    _HELD[0] += 1
    try:
        yield
    except BaseException:
        _DEFERRED.clear()
        raise
    finally:
        _HELD[0] -= 1
    if _DEFERRED and not _HELD[0]:
        signum = _DEFERRED[0]
        _DEFERRED.clear()
        if ARMED[0]:
            raise Stopped(signum)
