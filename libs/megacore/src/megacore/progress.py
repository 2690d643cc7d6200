"""The progress line every tool shows on a terminal (and never in a log file or a pipe).

`Progress("mega-convert", "tensors", total=291, total_bytes=13.5e9)` then `update(1, nbytes)` per
item redraws one line on stderr at most twice a second:
`mega-convert: 120/291 tensors (41/s), 6.2/13.5 GB (210 MB/s), ETA 0:35`.
"""

from __future__ import annotations

import sys
import time


def plural(n: int, word: str) -> str:
    """`1 file`, `2 files`, `1,024 tensors`."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts items (and bytes, and named extras such as tokens) and shows rates and an ETA."""

    def __init__(
        self,
        prog: str,
        unit: str,
        total: int | None = None,
        total_bytes: int | None = None,
        extras: tuple[str, ...] = (),
        enabled: bool | None = None,
    ) -> None:
        self.prog, self.unit, self.total, self.total_bytes = prog, unit, total, total_bytes
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.items = self.bytes = 0
        self.extras = dict.fromkeys(extras, 0)
        self.t0 = self.last = time.perf_counter()

    def update(self, items: int = 1, nbytes: int = 0, **extras: int) -> None:
        self.items += items
        self.bytes += nbytes
        for k, v in extras.items():
            self.extras[k] += v
        now = time.perf_counter()
        if self.enabled and now - self.last >= 0.5:
            self.last = now
            self._draw(now, end="")

    def done(self) -> None:
        """The final line (on a terminal)."""
        if self.enabled:
            self._draw(time.perf_counter(), end="\n")

    def line(self, now: float | None = None) -> str:
        dt = max((now or time.perf_counter()) - self.t0, 1e-9)
        of = f"/{self.total:,}" if self.total is not None else ""
        parts = [f"{self.items:,}{of} {self.unit} ({self.items / dt:,.0f}/s)"]
        parts += [f"{v:,} {k} ({v / dt:,.0f}/s)" for k, v in self.extras.items()]
        if self.bytes or self.total_bytes:
            gb = f"{self.bytes / 1e9:.2f}" + (f"/{self.total_bytes / 1e9:.2f}" if self.total_bytes else "")
            parts.append(f"{gb} GB ({self.bytes / dt / 1e6:,.0f} MB/s)")
        done, total = (self.bytes, self.total_bytes) if self.total_bytes else (self.items, self.total)
        if total and 0 < done < total:
            parts.append(f"ETA {_duration((total - done) * dt / done)}")
        return f"{self.prog}: " + ", ".join(parts)

    def _draw(self, now: float, end: str) -> None:
        print(f"\r{self.line(now)}\033[K", end=end, file=sys.stderr, flush=True)
