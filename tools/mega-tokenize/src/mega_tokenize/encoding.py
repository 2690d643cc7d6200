"""Parsed batches to ids: encoded on a pool of threads, handed back in input order, and the
engine's ids checked against the reference tokenizer's on a sample of every batch."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from mega_tokenize.parsing import Parsed
from mega_tokenize.tokenizer import Engine, Tokenizer, verify_engine
from megacore.background import result
from megacore.signals import signals_held

if TYPE_CHECKING:
    from mega_tokenize.job import Job

Encoded = dict[str, tuple[np.ndarray, np.ndarray]]  # per key: the batch's ids and each document's length


class EngineDisagrees(Exception):
    """The engine's ids differ from the reference tokenizer's (`reference`: its engine's name)."""

    def __init__(self, problem: str, reference: str) -> None:
        super().__init__(problem)
        self.reference = reference


class EngineChecks:
    """The engine's ids against the reference's on a sample of every batch, on a thread of its own
    (off the critical path)."""

    def __init__(self, tok: Tokenizer, engine: Engine) -> None:
        self.tok, self.engine = tok, engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mega-tokenize-check")
        self.pending: deque[Future] = deque()

    def sampled(self, batches: Iterable[Parsed]) -> Iterator[Parsed]:
        """Each batch once its sample is queued for the check."""
        for i, parsed in enumerate(batches):
            first = i == 0
            sample = _sample(parsed, first)
            with signals_held():  # see megacore.background: the pool may start its thread
                self.pending.append(
                    self.pool.submit(verify_engine, self.tok, self.engine, sample, probes=first)
                )
            self.passed(wait=False)  # stop early on a disagreement
            yield parsed

    def passed(self, wait: bool) -> None:
        """Raise `EngineDisagrees` for the first finished check (with `wait`: any) that disagrees."""
        while self.pending and (wait or self.pending[0].done()):
            if problem := result(self.pending.popleft()):
                raise EngineDisagrees(problem, self.tok.reference().name)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _sample(parsed: Parsed, first: bool) -> list[str]:
    """What the engine is checked on: documents spread evenly over the batch, up to 128 KB of the
    first batch and 32 KB of every later one (about 0.2% of the input at the default batch size)."""
    if parsed.chats is not None:
        texts = [p.text for c in parsed.chats for p in c if p.text]
    else:
        texts = [t for ts in parsed.texts.values() for t in ts]
    budget, picked = (128 if first else 32) << 10, []
    step = max(1, len(texts) // max(1, budget // 2048))  # ~2 KB documents: about budget/2KB of them
    for t in texts[::step]:
        if budget <= 0:
            break
        picked.append(t[:16384])
        budget -= len(picked[-1])
    return picked


class Encoder:
    """One batch to checked ids, BOS/EOS-wrapped for text (the markers of a conversation or a
    preference pair are added when it is written). Runs on a pool thread: numpy and the engines release the GIL, so the main
    thread only writes."""

    def __init__(self, job: Job, engine: Engine) -> None:
        self.engine, self.tok, self.keys = engine, job.tok, job.keys
        self.bos, self.eos, self.dtype = job.bos, job.eos, job.dtype

    def __call__(self, parsed: Parsed) -> Encoded:
        if parsed.chats is not None:
            if not parsed.chats:
                return {}
            texts = [p.text for c in parsed.chats for p in c if p.text is not None]
            empty = (np.zeros(0, np.uint32), np.zeros(0, np.int64))
            flat, lengths = self.engine.encode(texts) if texts else empty
            self.tok.check_no_special(flat)
            return {self.keys[0]: (flat, lengths)}  # the one shard of conversations or pairs
        encoded = {}
        for k in self.keys:
            if parsed.texts[k]:
                flat, lengths = self.engine.encode(parsed.texts[k])
                self.tok.check_no_special(flat)
                encoded[k] = _wrap(flat, lengths, self.bos, self.eos, self.dtype)
        return encoded


def _wrap(
    flat: np.ndarray, lengths: np.ndarray, bos: int | None, eos: int | None, dtype: str = "uint32"
) -> tuple[np.ndarray, np.ndarray]:
    """Insert BOS before and/or EOS after every document, vectorized, straight into `dtype`."""
    if bos is None and eos is None:
        return flat.astype(dtype, copy=False), lengths
    extra = (bos is not None) + (eos is not None)
    new_lengths = lengths + extra
    ends = np.cumsum(new_lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    marks = np.zeros(len(out), dtype=bool)
    if eos is not None:
        marks[ends - 1] = True
    if bos is not None:
        marks[ends - new_lengths] = True
    out[~marks] = flat  # the documents' own tokens, in order, around the marks
    if eos is not None:
        out[ends - 1] = eos
    if bos is not None:
        out[ends - new_lengths] = bos
    return out, new_lengths


def in_order(
    batches: Iterable[Parsed], encode: Callable[[Parsed], Encoded], pool: ThreadPoolExecutor, ahead: int
) -> Iterator[tuple[Parsed, Encoded]]:
    """Each batch with its encoding, in input order. `ahead` batches encode at once and one more
    waits, so no encoding thread idles while the caller writes."""
    pending: deque[tuple[Parsed, Future]] = deque()
    for parsed in batches:
        with signals_held():  # see megacore.background: the pool may start a thread
            pending.append((parsed, pool.submit(encode, parsed)))
        if len(pending) > ahead:
            done, fut = pending.popleft()
            yield done, result(fut)
    while pending:
        done, fut = pending.popleft()
        yield done, result(fut)
