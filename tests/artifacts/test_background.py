"""megacore.background: helper threads a caller never closed do not outlive the interpreter, and a stop
signal while the caller waits on one never leaves both waiting."""

import os
import subprocess
import sys
import textwrap

# A source thread doing torch work, never closed, then exit 3: the shape of a tool stopped by a
# signal between starting the thread and the `try` that closes it (seen in CI as mega-convert
# exiting -6 instead of 130 on Ctrl-C).
LEAK = textwrap.dedent(
    """
    import sys, torch
    from megacore.background import Background

    def tensors():
        while True:
            a = torch.randn(512, 512)
            yield torch.cat([a, a]).contiguous()

    source = Background.source(tensors(), depth=1)
    next(iter(source))
    sys.exit(3)
    """
)


def test_an_unclosed_thread_in_torch_code_does_not_abort_the_exit():
    """Without the exit hook, finalization stops the daemon thread inside a torch op and the C++
    runtime aborts ("terminate called without an active exception", exit -6): 4 runs in 4 before
    the fix. Each run here must end with its own exit code and a clean stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", LEAK], capture_output=True, text=True, env=env, timeout=120
        )
        assert (proc.returncode, proc.stderr) == (3, ""), (proc.returncode, proc.stderr)


# The signal arrives while the main thread is inside `Thread.start()` (the helper sends it first
# thing), under the tools' own handler (megacore.cli.run): it must not be raised before the thread
# is registered for the exit hook.
SIGNAL_IN_START = textwrap.dedent(
    """
    import os, signal, sys, torch, typer
    from megacore.background import Background
    from megacore.cli import run

    def tensors():
        os.kill(os.getpid(), signal.SIGINT)
        while True:
            a = torch.randn(512, 512)
            yield torch.cat([a, a]).contiguous()

    app = typer.Typer()

    @app.command()
    def main() -> None:
        source = Background.source(tensors(), depth=1)
        for _ in source:
            pass

    sys.exit(run(app, "t"))
    """
)


def test_a_signal_while_the_thread_starts_does_not_abort_the_exit():
    """Without holding the signals in `start()`, the handler raises there, the thread is never
    registered, keeps running in torch code, and the exit aborts (-6)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", SIGNAL_IN_START], capture_output=True, text=True, env=env, timeout=120
        )
        assert (proc.returncode, proc.stderr) == (130, "t: error: interrupted\n"), (
            proc.returncode,
            proc.stderr,
        )


# Ctrl-C raised right after a call inside `threading`'s lock handling (a Condition's enter, exit,
# wait or notify, a thread's start or join: picked by a seeded draw from the main thread's profile
# events), 300 times in one process, each stop a whole run of a command as `megacore.cli.run`
# handles it. A hang dumps every thread and exits 1.
STOPS = textwrap.dedent(
    """
    import faulthandler, hashlib, os, random, signal, sys, threading, typer
    from megacore.background import Background, Jobs, result
    from megacore.cli import run

    POINTS = {"__enter__", "__exit__", "_release_save", "_acquire_restore", "wait", "notify", "start",
              "join", "_wait_for_tstate_lock", "set"}
    draw = random.Random(0)
    armed = [False]

    def stop_here(frame, event, arg):
        code = frame.f_code
        if (
            armed[0] and event in ("call", "c_return") and code.co_filename == threading.__file__
            and code.co_name in POINTS and draw.random() < 0.2
        ):
            armed[0] = False
            signal.raise_signal(signal.SIGINT)

    def work(item):
        return hashlib.sha256(bytes(1 << 16)).digest()

    app = typer.Typer()

    @app.command()
    def main() -> None:
        armed[0] = True
        sys.setprofile(stop_here)
        try:
            while True:
                sink = Background.sink(work)
                try:
                    for i in range(100):
                        sink.put(i)
                    sink.close()
                except BaseException:
                    sink.cancel()
                    raise
                source = Background.source(work(i) for i in range(100))
                try:
                    for _ in source:
                        pass
                finally:
                    source.close()
                jobs = Jobs(2)
                try:
                    for future in [jobs.submit(work, i, lane=i % 3) for i in range(20)]:
                        result(future)
                finally:
                    jobs.cancel()
        finally:
            sys.setprofile(None)

    faulthandler.dump_traceback_later(60, exit=True)
    codes = [run(app, "t") for _ in range(300)]
    print(sorted(set(codes)), codes.count(130))
    """
)


def test_a_stop_inside_threading_lock_handling_never_hangs_the_waits_on_helpers():
    """A stop handler raising inside `threading`'s lock handling (where a queue's put or get, a
    join, a thread's start wait) left a lock released under the helper thread or a wake-up lost,
    and both threads waited forever (CI: mega-convert on Ctrl-C, the main thread joining a sink
    whose thread waited on an empty queue; here 1 run of the real tool in 160). Before
    `signals_held` this script hung at once, 3 runs in 3."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", STOPS], capture_output=True, text=True, env=env, timeout=180)
    assert (proc.returncode, proc.stdout) == (0, "[130] 300\n"), (proc.returncode, proc.stderr[-3000:])
    assert set(proc.stderr.splitlines()) == {"t: error: interrupted"}
