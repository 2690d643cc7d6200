"""What keeps a run safe while nobody watches it: one run per directory, stop requests, and a
launcher that died.

**The lock.** A run holds `<out>/.lock` (pid, host, start time, as JSON) from before it writes
anything until it ends; rank 0 takes it and the other ranks wait for its verdict. The file is also
`flock`ed while held, so on this host a live holder is known for sure and a crashed one (even
SIGKILLed) releases it. A second launch on the same `out` exits 2 naming the live run. A lock left
behind by a process that no longer exists on this host (its pid gone, or held by a process started
at another time: a restarted container reuses pids) is taken over with one line; one left by
another host is refused, naming that host, since its process cannot be checked from here.

**Stop requests.** SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (SLURM's warning before preemption) set a
flag that the training loop reads at each step boundary: it saves one checkpoint and stops. A
second SIGINT aborts at once (exit 130, nothing more written, a checkpoint being written removed
by `on_abort`); one that arrives within
`SECOND_SIGINT_S` of the first counts as the same press, since a terminal's Ctrl-C reaches the
launcher (which forwards it) and the workers alike.

**The launcher.** Under torchrun or `mega-train --nproc-per-node` (`launch.py`) each worker watches
its parent process; when the launcher dies without stopping it (SIGKILL), the worker exits within
`WATCH_S` seconds, writing nothing more. A stop signal that no Python handler has run for within
`STUCK_S` (the main thread blocked in C code: a collective whose peer died, a connect) ends the
worker at once (`watch_signals`): the launcher then stops or restarts the job without waiting out
its grace period.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megacore import env
from megacore.artifacts.output import pid_alive
from megacore.errors import UserError
from megacore.signals import handled_signals, mark_handled

LOCK_FILE = ".lock"
SECOND_SIGINT_S = 1.0
WATCH_S = 1.0
STUCK_S = 2.0  # a stop signal no Python handler has run for by then: the main thread is stuck in C
ABORTED = 130  # the exit status of a second Ctrl-C, as a shell reports SIGINT


class RunLock:
    """`<out>/.lock`, held from `acquire` to `release` (module docstring)."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_FILE
        self.fd: int | None = None
        self.took_over: dict | None = None  # the dead holder's record, when its lock was taken over

    def acquire(self, where: str) -> None:
        """Take the lock or raise a UserError naming the run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            held = _read(fd)
            if not _flock(fd) or (held and not self._stale(held)):
                raise UserError(self._refusal(held), where)
        except BaseException:
            os.close(fd)
            raise
        self.took_over = held or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode() + b"\n", 0)
        os.fsync(fd)
        self.fd = fd

    @staticmethod
    def _stale(held: dict) -> bool:
        """Whether the run that wrote `held` (which no longer holds the flock) is gone: a process of
        this host that no longer exists, or an earlier start of this same SLURM job (requeued)."""
        job = env.get("SLURM_JOB_ID")
        if job is not None and held.get("job") == job:
            return True
        if held.get("host") != socket.gethostname():
            return False
        pid = int(held.get("pid", 0))
        # A pid alive now may be another process's: a restarted container (a new pid namespace
        # under the same host name) or a reboot hands the dead run's pid out again.
        return not pid_alive(pid) or held.get("start", _start_of(pid)) != _start_of(pid)

    def _refusal(self, held: dict) -> str:
        out = self.path.parent
        if held and held.get("host") != socket.gethostname():
            return (
                f"{out} is locked by {describe(held)}, whose process cannot be checked from this host; "
                f"if that run is gone, delete {self.path}"
            )
        return f"{out} is in use by {describe(held)}; wait for it to end or stop it"

    def release(self) -> None:
        """Empty the record (a clean end leaves nothing to take over) and drop the flock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None


def _flock(fd: int) -> bool:
    """Whether this process now holds the flock: False when another does. A file system without
    flock (some network mounts) proves nothing either way: the record alone decides there."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _start_of(pid: int) -> str | None:
    """Process `pid`'s identity beyond its number: the boot and its start time (clock ticks since
    boot, /proc's stat); None where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}/{ticks}"


def _holder() -> dict:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    record["start"] = _start_of(os.getpid())
    if env.get("SLURM_JOB_ID") is not None:
        record["job"] = env.get("SLURM_JOB_ID")
    return record


def held_by(path: Path) -> dict | None:
    """The record of the live run holding the lock at `path` (this host, or a file system that
    shares flock), else None; never takes or changes it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops a shared flock just taken
    return None


def describe(held: dict) -> str:
    if not held:
        return "another mega-train run"
    return f"mega-train pid {held.get('pid')} on {held.get('host')} (started {held.get('started')})"


class StopRequest:
    """The stop flag (module docstring): `signum` is the first signal that asked, 0 while none has."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0
        self._first = 0.0
        self.on_abort: Callable[[], None] | None = None  # what an abort undoes first (a save's staging)
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        mark_handled()
        now = time.monotonic()
        if self.signum == signal.SIGINT and signum == signal.SIGINT and now - self._first > SECOND_SIGINT_S:
            os.write(2, b"mega-train: error: interrupted again: stopped without saving\n")
            if self.on_abort is not None:
                with contextlib.suppress(Exception):
                    self.on_abort()
            os._exit(ABORTED)
        if not self.signum:
            self.signum, self._first = signum, now

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def watch_signals() -> threading.Thread | None:
    """Under a launcher: a daemon thread woken by every signal (`signal.set_wakeup_fd`) that ends
    this process when a stop signal is not handled within STUCK_S. Python runs its handlers in the
    main thread between bytecodes, never while it is blocked in C code (a collective whose peer is
    gone, a connect): torchrun's agent would wait out its grace period (30 s) and then SIGKILL it.
    Nothing is saved then; the newest checkpoint is where the run resumes. None without a launcher."""
    if env.get("TORCHELASTIC_RUN_ID") is None:
        return None
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    stops = {int(s) for s in StopRequest.SIGNALS}
    received = [handled_signals()]

    def watch() -> None:
        while True:
            signums = [s for s in os.read(read, 64) if s in stops]
            if not signums:
                continue
            received[0] += len(signums)
            deadline = time.monotonic() + STUCK_S
            while handled_signals() < received[0]:
                if time.monotonic() > deadline:
                    name = signal.Signals(signums[0]).name
                    os.write(
                        2, f"mega-train: error: {name} while blocked outside Python; rank stopped\n".encode()
                    )
                    os._exit(128 + signums[0])
                time.sleep(0.05)

    t = threading.Thread(target=watch, name="mega-train-signal-watch", daemon=True)
    t.start()
    return t


def watch_launcher() -> threading.Thread | None:
    """Under a launcher (torchrun sets TORCHELASTIC_RUN_ID): a daemon thread that ends this process
    when the launcher is gone (module docstring). None when there is no launcher to watch."""
    if env.get("TORCHELASTIC_RUN_ID") is None:
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os.write(2, f"mega-train: error: the launcher (pid {parent}) is gone; rank stopped\n".encode())
        os._exit(1)

    t = threading.Thread(target=watch, name="mega-train-launcher-watch", daemon=True)
    t.start()
    return t
