"""The process-wide allocator setting of a CPU training run (the library cannot make it: it is the
process's, and must come before the big allocations).

glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and returns it
on free, so each step page-faults its large activations and gradients in again (measured at 5-14%
of a CPU step). With mmap off for the heap (`M_MMAP_MAX` 0) and trimming raised, freed blocks stay
in the heap and the next step reuses them. `MEGA_TRAIN_MALLOC=default` keeps glibc's behaviour.
Accelerators have caching allocators of their own; nothing is changed there.

Measured with `python bench/run.py train` (see the closing figures in bench/bench_train.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def configure_allocator(device: str) -> str:
    """Apply the allocator setting for a run on `device`; returns what was done, for the log."""
    mode = os.environ.get("MEGA_TRAIN_MALLOC", "default")
    if device != "cpu" or mode != "heap":
        return "default"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune this way
        return "default"
    return "heap" if ok else "default"
