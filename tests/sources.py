"""The Python sources of libs/ and tools/ that the code checks read (layers, sizes, the environment),
walked one way: every .py file, but under build outputs and hidden directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def python_sources(root: Path, tops: tuple[str, ...] = ("libs", "tools")) -> Iterator[tuple[Path, Path]]:
    """(path, path relative to `root`) of every .py file under root/<top> for each of `tops` (the
    packages' sources by default), sorted."""
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if not any(p in SKIP_DIRS or p.startswith(".") for p in rel.parts):
                yield path, rel
