"""The one background-I/O helper: threads that overlap the caller's work.

File reads and writes, sha256, decompression and the tokenizer engines release the GIL, so a
helper thread doing one of them overlaps the caller's work. `Background`: one thread joined to the
caller by a short bounded queue, in two shapes:

- `Background.sink(fn)`: the caller `put`s items, the thread calls `fn(item)` on each, in order
  (sha256 of a file being written, writing blocks to a file while the next ones are read,
  flushing a growing token shard to the device);
- `Background.source(items)`: the thread produces `items` ahead of the caller, who iterates
  (reading and parsing the next batch, loading the next tensor).

The queue is bounded (`depth`), so memory stays at a few items. An exception in the thread is
re-raised in the caller at its next `put`, iteration or `close`; `cancel` stops the thread early.
A thread its caller never closed (an exception or a signal between starting it and the `try` that
would close it) is cancelled at interpreter exit: left running, a thread inside a torch op when
Python finalizes aborts the process ("terminate called without an active exception", exit 134)
instead of its exit code.

Every wait of the caller on a helper thread (a queue, a join, a thread's start, a future) holds
the tools' stop signals (`megacore.signals.signals_held`): Ctrl-C is raised when the wait ends, never
inside `threading`'s lock handling, where it can leave both threads waiting forever. Waits with
no bound (the next item of a source, a future's result) poll, so a stop ends them at once.

`Jobs`: independent calls on a few threads, each answered by a future; calls of one `lane` run one
after another (several files hashed at once while the caller reads them, each file's pieces in
turn: artifacts/tensors.py's `TensorReader`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from megacore.signals import signals_held

T = TypeVar("T")

_END = object()
POLL_S = 0.1  # how often a wait with no bound lets a stop signal through
_LIVE: weakref.WeakSet[Background] = weakref.WeakSet()  # started and not yet joined


@atexit.register  # runs before finalization stops daemon threads where they stand
def _cancel_live() -> None:
    for bg in list(_LIVE):
        bg.cancel()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Background:
    """Use the constructors `sink` and `source`."""

    def __init__(self, kind: str, depth: int, name: str) -> None:
        self._kind = kind  # "sink" or "source"
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name

    def _start(self, target: Callable[[], None]) -> Background:
        self._thread = threading.Thread(target=target, name=self._name, daemon=True)
        # Held until the thread is registered for the exit hook too: a stop raised inside `start()`
        # would leave it running unregistered (CI: mega-convert -6 on Ctrl-C).
        with signals_held():
            self._thread.start()
            _LIVE.add(self)
        return self

    # --- sink ------------------------------------------------------------------------------------

    @classmethod
    def sink(cls, fn: Callable[[Any], None], depth: int = 2, name: str = "mega-sink") -> Background:
        """A thread calling `fn` on every `put` item, in order."""
        self = cls("sink", depth, name)

        def work() -> None:
            while (item := self._q.get()) is not _END:
                if self._error is None and not self._stop.is_set():
                    try:
                        fn(item)
                    except BaseException as e:  # re-raised in the caller
                        self._error = e

        return self._start(work)

    def put(self, item: object) -> None:
        if self._error is not None:
            raise self._error
        with signals_held():  # bounded: the thread frees a place once it has handled one item
            self._q.put(item)

    def offer(self, item: object) -> bool:
        """`put` unless the queue is full (then drop the item and return False): for work that only
        gives a head start, such as flushing a file early."""
        if self._error is not None:
            raise self._error
        try:
            with signals_held():
                self._q.put_nowait(item)
        except queue.Full:
            return False
        return True

    # --- source ----------------------------------------------------------------------------------

    @classmethod
    def source(cls, items: Iterable[Any], depth: int = 2, name: str = "mega-source") -> Background:
        """A thread producing `items` up to `depth` ahead; iterate the returned object."""
        self = cls("source", depth, name)

        def offer(item: object) -> bool:
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                for item in items:
                    if not offer(item):
                        return
                offer(_END)
            except BaseException as e:
                offer(_Failed(e))

        return self._start(work)

    def __iter__(self) -> Iterator[Any]:
        while (item := self._next()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def _next(self) -> object:
        while True:
            with signals_held():
                try:
                    return self._q.get(timeout=POLL_S)
                except queue.Empty:
                    pass

    # --- both ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Sink: wait until every item is handled, then re-raise the thread's error if any.
        Source: stop producing (the caller may have stopped iterating early)."""
        if self._thread is None:
            return
        if self._kind == "source":
            self.cancel()
            return
        with signals_held():  # bounded: the queued items (`depth`) are all that is left to handle
            self._q.put(_END)
            self._thread.join()
            self._thread = None
            _LIVE.discard(self)
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop the thread without waiting for queued work (after a failure elsewhere)."""
        if self._thread is None:
            return
        with signals_held():  # bounded: the item in hand, at most
            self._stop.set()
            if self._kind == "sink":
                self._q.put(_END)  # the sink drains without working once stopped
            self._thread.join()
            self._thread = None
            _LIVE.discard(self)


class Jobs:
    """Independent calls on up to `workers` threads, started as calls come, each answered by a
    `Future` (its result, or its exception re-raised by `result()`).

    `stop` is set by `cancel`: a long call takes it and checks it between blocks of work, so that
    a caller giving up (an error, Ctrl-C) neither waits for it nor leaves it running until the
    interpreter's exit, which joins these threads.

    `lane`: calls submitted with the same lane run one after another, in order, on one thread at a
    time (the pieces of one file hashed as one sequential pass would be, leaving the other threads
    to other files and the cores to the caller)."""

    def __init__(self, workers: int, name: str = "mega-jobs") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._lanes: dict[Hashable, deque[tuple[Future, Callable[..., Any], tuple]]] = {}

    def submit(self, fn: Callable[..., T], *args: Any, lane: Hashable | None = None) -> Future[T]:
        with signals_held():  # the pool may start a thread
            return self._submit(fn, *args, lane=lane)

    def _submit(self, fn: Callable[..., T], *args: Any, lane: Hashable | None) -> Future[T]:
        if lane is None:
            return self._pool.submit(fn, *args)
        future: Future[T] = Future()
        with self._lock:
            calls = self._lanes.setdefault(lane, deque())
            calls.append((future, fn, args))
            if len(calls) == 1:  # no thread is draining this lane: start one
                self._pool.submit(self._drain, lane)
        return future

    def _drain(self, lane: Hashable) -> None:
        """Run the lane's calls in order until it is empty."""
        while True:
            with self._lock:
                future, fn, args = self._lanes[lane][0]
            if future.set_running_or_notify_cancel():  # False: cancelled by `cancel`
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # re-raised by result()
                    future.set_exception(e)
            with self._lock:
                calls = self._lanes[lane]
                calls.popleft()
                if not calls:
                    del self._lanes[lane]
                    return

    def cancel(self) -> None:
        """Drop the calls not started, tell the running ones to stop (`stop`), and return at once:
        a thread still in a call ends when the call next checks `stop`."""
        with signals_held():
            self.stop.set()
            with self._lock:
                for calls in self._lanes.values():
                    for future, _, _ in calls:
                        future.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)


def result(future: Future[T]) -> T:
    """`future.result()`, waited for with stop signals held between polls (see the module's doc)."""
    while not future.done():
        with signals_held():
            wait([future], timeout=POLL_S)
    with signals_held():
        return future.result()
