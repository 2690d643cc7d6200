"""The docs stay true to the tools: each tool page holds its `--help` exactly as the tool prints it
(docs/gen_help.py writes them), every relative link in README.md and docs/*.md points at a file that
exists, and README.md stays a front door (at most 150 lines)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
REGENERATE = ".venv/bin/python docs/gen_help.py"
MAX_README_LINES = 150


def _gen_help():
    spec = importlib.util.spec_from_file_location("gen_help", DOCS / "gen_help.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_help = _gen_help()
COMMANDS = [(page, command) for page, commands in gen_help.PAGES.items() for command in commands]


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[" ".join(c) for _, c in COMMANDS])
def test_tool_page_holds_the_tools_help(page: str, command: tuple[str, ...]) -> None:
    """`<tool> [SUBCOMMAND] --help`, run now with COLUMNS=100, is exactly the page's block."""
    text = (DOCS / page).read_text()
    expected = gen_help.block(command, gen_help.help_text(command))
    assert text.count(gen_help.begin_marker(command)) == 1, (
        f"docs/{page}: no block for `{gen_help.label(command)}`; add its markers and run {REGENERATE}"
    )
    assert expected in text, f"docs/{page}: `{gen_help.label(command)}` changed; regenerate: {REGENERATE}"


def test_each_tool_page_starts_with_its_help() -> None:
    for page, commands in gen_help.PAGES.items():
        text = (DOCS / page).read_text()
        first = gen_help.begin_marker(commands[0])
        assert text.index(first) < text.index("\n## "), f"docs/{page}: the --help block comes first"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(path: Path) -> list[str]:
    """Every relative link target of a markdown file (`file#anchor`, `#anchor`), code left out."""
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code: `t.pipeline('x')('y')` is not a link
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http(s):


def _relative_links(path: Path) -> list[str]:
    return [t.split("#", 1)[0] for t in _links(path) if not t.startswith("#")]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


DOC_FILES = [README, *sorted(DOCS.glob("*.md")), ROOT / "bench" / "README.md"]


@pytest.mark.parametrize("doc", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_relative_links_point_at_files_that_exist(doc: Path) -> None:
    missing = [link for link in _relative_links(doc) if not (doc.parent / link).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_anchors_of_links_into_markdown_exist(doc: Path) -> None:
    broken = []
    for link in _links(doc):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target) if target else doc
        if anchor and path.suffix == ".md" and path.exists() and anchor not in _anchors(path):
            broken.append(link)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing headings: {broken}"


def test_the_link_check_sees_links() -> None:
    """A guard for the check above: README links to the tool pages, so it must find them."""
    assert "docs/mega-train.md" in _relative_links(README)


def test_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move reference text to docs/"
    )
