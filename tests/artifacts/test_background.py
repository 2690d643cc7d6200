"""megacore.background: helper threads a caller never closed do not outlive the interpreter."""

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
# thing): the handler must not run before the thread is registered for the exit hook.
SIGNAL_IN_START = textwrap.dedent(
    """
    import os, signal, sys, torch
    from megacore.background import Background

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop

    signal.signal(signal.SIGINT, stop)

    def tensors():
        os.kill(os.getpid(), signal.SIGINT)
        while True:
            a = torch.randn(512, 512)
            yield torch.cat([a, a]).contiguous()

    try:
        source = Background.source(tensors(), depth=1)
        for _ in source:
            pass
    except Stop:
        sys.exit(130)
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
        assert (proc.returncode, proc.stderr) == (130, ""), (proc.returncode, proc.stderr)
