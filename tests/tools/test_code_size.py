"""Size limits, checked with `ast`, nothing imported: no file under libs/ and tools/ over 600 lines
and no function there over 60 (a `def`'s lines, decorators not counted; methods and nested
functions too). A typer command (`@app.command(...)`) is mostly its option list, one parameter per
option, so it is held to its body instead: at most 60 lines from the first statement after its
docstring to its end. No file under tests/ or bench/ over 800 lines. Long code is split into
functions and modules named after what they hold.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sources import python_sources

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 600
MAX_TEST_FILE_LINES = 800  # tests/ and bench/
MAX_FUNCTION_LINES = 60


def _is_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated `@<app>.command(...)` (or `@<app>.command`): a typer command."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "command":
            return True
    return False


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From the first statement after the docstring (the docstring when it is all) to the end."""
    body = fn.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and isinstance(first.value.value, str) and len(body) > 1:
        first = body[1]
    return fn.end_lineno - first.lineno + 1


def _lines(text: str) -> int:
    """As `wc -l` counts them, and an unended last line too."""
    return text.count("\n") + int(bool(text) and not text.endswith("\n"))


def check_file(path: Path, rel: Path) -> list[str]:
    """The limits `path` breaks, each as "rel:line: what"."""
    text = path.read_text(encoding="utf-8")
    problems = []
    lines = _lines(text)
    if lines > MAX_FILE_LINES:
        problems.append(f"{rel}:1: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, str(rel))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        if not _is_command(node):
            problems.append(
                f"{rel}:{node.lineno}: {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})"
            )
        elif (body := _body_lines(node)) > MAX_FUNCTION_LINES:
            problems.append(
                f"{rel}:{node.lineno}: command {node.name}'s body is {body} lines (at most {MAX_FUNCTION_LINES})"
            )
    return problems


def check(root: Path) -> list[str]:
    """Every limit broken by a .py file under root/libs and root/tools, or root/tests and root/bench."""
    problems = []
    for path, rel in python_sources(root):
        problems += check_file(path, rel)
    for path, rel in python_sources(root, ("tests", "bench")):
        lines = _lines(path.read_text(encoding="utf-8"))
        if lines > MAX_TEST_FILE_LINES:
            problems.append(f"{rel}:1: {lines} lines (at most {MAX_TEST_FILE_LINES})")
    return problems


def test_no_file_or_function_over_the_limits() -> None:
    problems = check(REPO)
    assert not problems, "over the size limits (split them):\n" + "\n".join(problems)


def _function(name: str, lines: int, decorator: str = "", options: int = 0) -> str:
    """A function of exactly `lines` lines (def to end), `options` of them parameters, after `decorator`."""
    params = "".join(f"    o{i}: int = typer.Option(0),\n" for i in range(options))
    statements = lines - options - 3  # besides the def line, the ") -> None:" line and the docstring
    return f'{decorator}def {name}(\n{params}) -> None:\n    """Doc."""\n' + "    x = 1\n" * statements


def _line(path: Path, start: str) -> int:
    """The number of the first line of `path` that starts with `start`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(start))


def test_the_checker_reports_what_is_over(tmp_path: Path) -> None:
    """Planted code: every kind of breach is reported with its file and line, nothing at the limits."""
    pkg = tmp_path / "libs" / "pkg" / "src" / "pkg"
    pkg.mkdir(parents=True)
    at_limit, over = _function("fits", 60), _function("too_long", 61)
    assert len(at_limit.splitlines()) == 60 and len(over.splitlines()) == 61
    method = "class C:\n" + "".join(f"    {line}\n" for line in _function("method", 61).splitlines())
    (pkg / "funcs.py").write_text(f"{at_limit}\n\n{over}\n\n{method}")
    options_only = _function("run", 100, "@app.command()\n", options=60)  # a body of 37 lines
    long_body = _function("go", 100, "@app.command(help='x')\n", options=30)  # a body of 67 lines
    (pkg / "cli.py").write_text(f"import typer\n\napp = typer.Typer()\n\n\n{options_only}\n\n{long_body}")
    (pkg / "big.py").write_text("x = 1\n" * 601)
    (pkg / "fits.py").write_text("x = 1\n" * 600)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_big.py").write_text("x = 1\n" * 801)
    (tmp_path / "tests" / "test_fits.py").write_text("x = 1\n" * 800)
    skipped = tmp_path / "tools" / "t" / "build" / "lib"  # a build's copy is not the source
    skipped.mkdir(parents=True)
    (skipped / "copy.py").write_text("x = 1\n" * 601)

    rel = Path("libs/pkg/src/pkg")
    assert check(tmp_path) == [
        f"{rel / 'big.py'}:1: 601 lines (at most 600)",
        f"{rel / 'cli.py'}:{_line(pkg / 'cli.py', 'def go(')}: command go's body is 67 lines (at most 60)",
        f"{rel / 'funcs.py'}:{_line(pkg / 'funcs.py', 'def too_long(')}: too_long is 61 lines (at most 60)",
        f"{rel / 'funcs.py'}:{_line(pkg / 'funcs.py', '    def method(')}: method is 61 lines (at most 60)",
        "tests/test_big.py:1: 801 lines (at most 800)",
    ]
