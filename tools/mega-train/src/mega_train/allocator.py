"""The process-wide allocator setting of a CPU training run (the library cannot make it: it is the
process's, and must come before the big allocations).

glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and returns it
on free, so each step page-faults its large activations and gradients in again (measured at 5-14%
of a CPU step). With mmap off for the heap (`M_MMAP_MAX` 0) and trimming raised, freed blocks stay
in the heap and the next step reuses them. `MEGA_TRAIN_MALLOC=default` keeps glibc's behaviour.
Accelerators have caching allocators of their own; nothing is changed there.

Measured (2 threads, bf16, a 6-layer hidden-512 Llama with a 32k vocab, 4 x 512 tokens per step,
median step time of steps 3-6, six interleaved rounds of `MEGA_TRAIN_MALLOC=default` then `heap`):
default/heap per round 1.32, 1.01, 1.05, 0.93, 1.35, 1.25 (median 1.15x faster with heap), peak
RSS 2.28 GB with heap against 2.23-2.27 GB with glibc's default: on by default on CPU.

Heap mode fragments: the few small allocations that outlive a microbatch (autograd and Python
objects, the adapters' gradients) land in the holes its activations leave, so the next one's large
tensors no longer fit there and the heap grows instead. A LoRA step on a 125M Llama (2 microbatches
of 4 x 512, fp32; mallinfo2): 0.65 GB in use and 3.34 GB free in a 4.00 GB heap before the second
microbatch, and the heap at 5.38 GB after its forward, with 2.44 GB in use; peak RSS 5.72-6.44 GB
over runs. `malloc_trim(0)` before each microbatch hands the free pages inside the heap back
(MADV_DONTNEED): peak RSS 4.86 GB. The pages come back as page faults: steps alternately with and
without it in one run, 20.53 s against 18.75 s (mean of 5), 0.5 s of it in the trim calls.

So the trim is made where it pays: in a run whose base is frozen (LoRA, QLoRA), and there only
once the heap has grown past what the run's first microbatch left it (`TrimOnceFragmented`), the
sign that the holes no longer fit a microbatch. A full fine-tuning's gradients are allocated once,
at the first microbatch's backward, and its heap does not grow this way, while every microbatch
would pay the page faults: trimming every run (a88b696) took the CPU trainer from 1.42x
transformers' Trainer to 1.07x (issue #56; the bisect in bench/README.md, "Guarded ratios"). A bf16
LoRA step of the same model does not fragment (its heap 2.79 GB after the first step and after
the 14th, peak RSS 2.87-2.92 GB): trimming it anyway cost 20% of its step (4.7-5.2 s against
5.5-6.0 s), so it is not trimmed until its heap grows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

from megacore import env

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): nothing to tune this way
        return None


class Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): `arena` is the bytes its heaps hold from the system."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class TrimOnceFragmented:
    """Called before each microbatch (its index in the step): from the start of the second step
    on, once the heap holds more than `GROWTH` times what it held then (a microbatch needed more
    than the holes the last ones left), `malloc_trim(0)` before this and every later microbatch.
    Without `mallinfo2` (glibc before 2.33) the heap cannot be read: every microbatch is trimmed."""

    GROWTH = 1.1

    def __init__(self, libc: ctypes.CDLL) -> None:
        self.libc = libc
        self.info = getattr(libc, "mallinfo2", None)
        if self.info is not None:
            self.info.restype = Mallinfo2
        self.trimming = self.info is None
        self.steps = 0
        self.heap = 0  # bytes, at the second step's start: what a whole step left

    def __call__(self, microbatch: int) -> None:
        if not self.trimming and microbatch == 0:
            self.steps += 1
            if self.steps > 1:
                heap = self.info().arena
                self.heap = self.heap or heap
                self.trimming = heap > self.GROWTH * self.heap
        if self.trimming:
            self.libc.malloc_trim(0)


def configure_allocator(device: str, frozen_base: bool = False) -> Callable[[int], None] | None:
    """Apply the allocator setting for a run on `device`. Returns, in heap mode for a run whose
    base is frozen (`frozen_base`: LoRA), what to call before each microbatch of a step
    (`ParallelModel.before_microbatch`: a `TrimOnceFragmented`); else None."""
    libc = _glibc() if device == "cpu" and env.get("MEGA_TRAIN_MALLOC", "heap") == "heap" else None
    if libc is None or libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1:
        return None
    return TrimOnceFragmented(libc) if frozen_base else None
