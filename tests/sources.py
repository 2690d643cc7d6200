"""The Python sources of libs/ and tools/ that the code checks read (layers, sizes, the environment),
walked one way: every .py file, but under build outputs and hidden directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def python_sources(root: Path) -> Iterator[tuple[Path, Path]]:
    """(path, path relative to `root`) of every .py file under root/libs and root/tools, sorted."""
    for top in ("libs", "tools"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if not any(p in SKIP_DIRS or p.startswith(".") for p in rel.parts):
                yield path, rel
