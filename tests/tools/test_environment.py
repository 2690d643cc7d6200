"""Every environment variable the tools read is in one table (`megacore.env.VARIABLES`), shown in
docs/architecture.md, and read through it: `os.environ` appears in no module of libs/ or tools/
but that table's (`megacore/env.py`) and the tools' command lines (`cli.py`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megacore import env
from sources import python_sources

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
ALLOWED = {"env.py", "cli.py"}


def environ_users(root: Path) -> list[str]:
    """file:line of every use of `os.environ` (or `os.getenv`, `os.putenv`) under libs/ and tools/
    outside the allowed modules."""
    found = []
    for path, _ in python_sources(root):
        if path.name in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv", "putenv")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_table_and_the_command_lines_read_the_environment() -> None:
    users = environ_users(ROOT)
    assert not users, f"read the variable through megacore.env (and list it in VARIABLES): {users}"


def test_the_check_sees_a_planted_read(tmp_path: Path) -> None:
    (tmp_path / "libs" / "x").mkdir(parents=True)
    (tmp_path / "libs" / "x" / "mod.py").write_text("import os\n\nX = os.environ.get('Y')\n")
    (tmp_path / "libs" / "x" / "cli.py").write_text("import os\n\nX = os.environ.get('Y')\n")
    assert environ_users(tmp_path) == ["libs/x/mod.py:3"]


def test_the_documented_table_is_the_code_s() -> None:
    """docs/architecture.md's rows are `VARIABLES`' exactly, in order, and no other."""
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| (.+?) \| (.+) \|$", DOC.read_text(encoding="utf-8"), re.M)
    assert rows == [(v.name, v.used_by, v.meaning) for v in env.VARIABLES]


def test_a_variable_outside_the_table_is_refused() -> None:
    import pytest

    with pytest.raises(KeyError, match="NOT_LISTED is not in megacore.env.VARIABLES"):
        env.get("NOT_LISTED")
