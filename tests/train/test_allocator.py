"""A LoRA run's allocator on a CPU (mega_train.allocator): the heap is trimmed before each
microbatch only once it has grown past what the first step left, in a process of its own (glibc's
settings are the process's), with real glibc and torch allocations.

A step here is two microbatches, each allocating 24 blocks of 4 MiB and freeing them. In the
fragmenting run every block is followed by a small tensor kept to the end (as autograd and the
adapters' gradients outlive a microbatch), which lands in the holes the last step left: they no
longer fit a block, and the heap grows. Without the kept tensors the holes merge and are reused."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"),
    reason="glibc with mallinfo2 (2.33+)",
)

SCRIPT = """
import json, sys, torch
from mega_train.allocator import configure_allocator

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

trim, kept, fragment, log = configure_allocator("cpu", frozen_base=True), [], sys.argv[1] == "1", []
for step in range(4):
    for microbatch in range(2):
        before, heap = resident(), trim.info().arena
        trim(microbatch)
        log.append({"trimming": trim.trimming, "released": before - resident(), "heap": heap})
        blocks = []
        for _ in range(24):
            blocks.append(torch.ones(1 << 22, dtype=torch.uint8))
            if fragment:
                kept.append(torch.ones(64 + step, dtype=torch.uint8))
        del blocks
print(json.dumps(log))
"""


def _run(fragment: bool) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if fragment else "0"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_heap_that_does_not_grow_is_never_trimmed() -> None:
    log = _run(fragment=False)
    assert not any(call["trimming"] for call in log)
    assert max(call["heap"] for call in log[2:]) <= 1.1 * log[2]["heap"]


def test_a_heap_that_fragments_is_trimmed_from_then_on() -> None:
    log = _run(fragment=True)
    assert not any(call["trimming"] for call in log[:3]), "the first step and the second's start"
    first = next(i for i, call in enumerate(log) if call["trimming"])
    assert log[first]["heap"] > 1.1 * log[2]["heap"]  # the heap it saw: grown past the second step's start
    assert all(call["trimming"] for call in log[first:])
    # each trim hands back the blocks' pages the last microbatch freed: 24 x 4 MiB, most of it
    assert all(call["released"] > 48 << 20 for call in log[first:])
