"""The import layers of docs/architecture.md ("Layers"), checked on the source with `ast`, nothing imported.

The layer order is parsed from the doc's code block, so reordering the doc reorders the test and the two
cannot drift. The prose rules under it (`models` never imports `parallel` nor `torch.distributed`: it holds no
parallel code; the torch-free modules; no tool imports another) are encoded here, as `MODELS_NOT_PARALLEL`, `TORCH_FREE` and the tool rule in `check`.

Every import counts, at module level or inside a function: a lazy import is still a dependency. Imports
under `if TYPE_CHECKING:` count for the layers (a type from a lower layer still couples the code to it) but
not for torch-freeness, whose point is start-up without torch, and those blocks never run.
`importlib.import_module` calls are not imports here: `megacore.artifacts`' lazy `__getattr__` loads
tensors.py that way on purpose, only when a torch name is asked for.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from sources import SKIP_DIRS, python_sources

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"

TOOLS = "tools/*"
MODELS_NOT_PARALLEL = ("models", "parallel")
# Modules (or packages) that never import torch, with the one exception the doc names.
TORCH_FREE = (
    "megacore.structs",
    "megacore.config_parts",
    "megacore.config",
    "megacore.parts",
    "megacore.artifacts",
    "megacore.tokenizer_files",
    "megacore.data",
    "megacore.parallel.layout",
    "megacore.parallel.dims",
    "megacore.parallel.build_rules",
    "megacore.planner",
    "megacore.env",
)
TORCH_FREE_EXCEPT = ("megacore.artifacts.tensors",)


def parse_layers(doc: str) -> list[tuple[str, ...]]:
    """The names of each layer, top first, from the first code block under "## Layers"."""
    section = doc.split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        # The names are the leading comma-separated words; the description follows after a space.
        m = re.match(r"([\w/*]+(?:, *[\w/*]+)*)\s", line)
        if m:
            layers.append(tuple(n.strip() for n in m.group(1).split(",")))
    return layers


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the dotted module imported, resolved to a submodule where `from X import sub` names one
    type_only: bool  # under `if TYPE_CHECKING:`


@dataclass(frozen=True)
class Module:
    name: str
    path: Path  # relative to the root, for messages
    imports: tuple[Import, ...]


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.detail}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache  # by source text: the planted trees re-parse only the file that changed, keeping the tests fast
def _raw_imports(text: str, package: str) -> tuple[tuple[int, str, tuple[str, ...], bool], ...]:
    """(line, module, names of `from module import names`, type_only) for every import in the source."""
    found = []

    def walk(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, (), type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found.append((node.lineno, base, tuple(a.name for a in node.names), type_only))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                walk(child, True)
            for child in node.orelse:
                walk(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, type_only)

    walk(ast.parse(text), False)
    return tuple(found)


def _ours(name: str) -> bool:
    top = name.split(".")[0]
    return top in {"torch", "megacore"} or top.startswith("mega_")


def scan(root: Path) -> tuple[dict[str, Module], list[Violation]]:
    """Every .py file under root/libs and root/tools, by dotted module name (the path below `src/`)."""
    files: dict[str, tuple[Path, str]] = {}
    problems = []
    for path, rel in python_sources(root):
        if "src" not in rel.parts[:-1]:
            problems.append(Violation(rel, 1, "unplaced", "not under a package's src/: no layer to check"))
            continue
        parts = list(rel.parts[rel.parts.index("src") + 1 :])
        parts[-1] = parts[-1].removesuffix(".py")
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = (rel, path.read_text(encoding="utf-8"))

    modules = {}
    for name, (rel, text) in files.items():
        package = name if rel.name == "__init__.py" else name.rpartition(".")[0]
        imports = []
        for line, mod, names, type_only in _raw_imports(text, package):
            # `from megacore.parallel import engine` depends on the module engine, not only the package.
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in files] or [mod]
            imports += [Import(line, t, type_only) for t in targets if _ours(t)]
        modules[name] = Module(name, rel, tuple(imports))
    return modules, problems


def _part(module: str) -> str | None:
    """The part of megacore a module is in (`megacore.parallel.layout` -> `parallel`), as the doc names it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megacore" and len(parts) > 1 else None


def _layer_of(module: str, index: dict[str, int]) -> int | None:
    if module.startswith("mega_"):
        return index[TOOLS]
    if module == "megacore":
        return 0  # the package's own __init__ holds only its version: importable by every layer
    return index.get(_part(module))


def _torch_free(module: str) -> bool:
    """The doc's torch-free modules, and the packages above them: importing a module runs those first."""
    if any(module == e or module.startswith(e + ".") for e in TORCH_FREE_EXCEPT):
        return False
    return any(module == t or module.startswith(t + ".") or t.startswith(module + ".") for t in TORCH_FREE)


def _runtime_targets(imp: Import) -> list[str]:
    """What an import executes: `import a.b.c` runs a, then a.b, then a.b.c."""
    parts = imp.target.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def check(root: Path, layers: list[tuple[str, ...]]) -> list[Violation]:
    modules, violations = scan(root)
    index = {name: i for i, names in enumerate(layers) for name in names}

    @cache
    def torch_path(module: str, seen: frozenset[str] = frozenset()) -> tuple[str, ...] | None:
        """A chain of runtime imports from module to torch, if there is one."""
        if module == "torch" or module.startswith("torch."):
            return ("torch",)
        if module not in modules or module in seen:
            return None
        runtime = [imp for imp in modules[module].imports if not imp.type_only]
        # A direct torch import first, so the chain reported is the shortest at this step.
        if any(imp.target.split(".")[0] == "torch" for imp in runtime):
            return ("torch",)
        for imp in runtime:
            for target in _runtime_targets(imp):
                rest = torch_path(target, seen | {module})
                if rest:
                    return (target, *rest)
        return None

    for mod in modules.values():
        src_layer = _layer_of(mod.name, index)
        if src_layer is None:
            violations.append(
                Violation(mod.path, 1, "layers", f"{mod.name} is in no layer of the doc's table")
            )
            continue
        for imp in mod.imports:
            where = (mod.path, imp.line)
            if imp.target.split(".")[0] == "torch":
                if _torch_free(mod.name) and not imp.type_only:
                    violations.append(Violation(*where, "no torch", f"{mod.name} imports {imp.target}"))
                if _part(mod.name) == "models" and imp.target.startswith("torch.distributed"):
                    violations.append(Violation(*where, "models", f"{mod.name} imports {imp.target}"))
                continue
            dst_layer = _layer_of(imp.target, index)
            if dst_layer is None:
                violations.append(
                    Violation(*where, "layers", f"{imp.target} is in no layer of the doc's table")
                )
            elif dst_layer > src_layer:
                violations.append(
                    Violation(
                        *where,
                        "layers",
                        f"{mod.name} (layer {', '.join(layers[src_layer])}) imports {imp.target}"
                        f" (layer {', '.join(layers[dst_layer])}, below it)",
                    )
                )
            src_top, dst_top = mod.name.split(".")[0], imp.target.split(".")[0]
            if src_top.startswith("mega_") and dst_top.startswith("mega_") and src_top != dst_top:
                violations.append(Violation(*where, "tools", f"{src_top} imports another tool, {imp.target}"))
            if (_part(mod.name), _part(imp.target)) == MODELS_NOT_PARALLEL:
                violations.append(Violation(*where, "models", f"{mod.name} imports {imp.target}"))
            # Through another module: reported here only where the chain leaves the torch-free modules,
            # since a torch-free module on the chain gets its own report.
            if _torch_free(mod.name) and not imp.type_only:
                for target in _runtime_targets(imp):
                    chain = None if _torch_free(target) else torch_path(target)
                    if chain:
                        route = " -> ".join((target, *chain))
                        violations.append(Violation(*where, "no torch", f"{mod.name} reaches torch: {route}"))
                        break
    return violations


@pytest.fixture(scope="module")
def layers() -> list[tuple[str, ...]]:
    return parse_layers(DOC.read_text(encoding="utf-8"))


def test_layer_table_parses(layers):
    # A parse that found nothing would make every import "in no layer" or, worse, pass vacuously.
    names = [n for layer in layers for n in layer]
    assert layers[0] == ("errors", "structs", "config_parts", "config", "env", "signals")
    assert layers[-1] == (TOOLS,)
    assert len(names) == len(set(names))
    assert {"artifacts", "tokenizer_files", "data", "models", "checkpoint", "parallel", "planner"} <= set(
        names
    )


def test_imports_follow_the_layers(layers):
    violations = check(REPO, layers)
    assert not violations, "\n" + "\n".join(map(str, violations))


def _copy_sources(root: Path) -> None:
    for top in ("libs", "tools"):
        shutil.copytree(
            REPO / top,
            root / top,
            ignore=lambda d, names: [
                n
                for n in names
                if n in SKIP_DIRS or n.startswith(".") or ((Path(d) / n).is_file() and not n.endswith(".py"))
            ],
        )


MEGACORE = "libs/megacore/src/megacore"

# (file, code appended, rule the checker must name, words its message must contain)
PLANTS = {
    "upward": (
        f"{MEGACORE}/config.py",
        "from megacore.parallel import engine",
        "layers",
        "megacore.parallel.engine",
    ),
    "upward reaches torch": (
        f"{MEGACORE}/config.py",
        "from megacore.parallel import engine",
        "no torch",
        "megacore.parallel.engine -> torch",
    ),
    "models to torch.distributed": (
        f"{MEGACORE}/models/moe.py",
        "def _planted():\n    from torch.distributed.tensor import DTensor",
        "models",
        "torch.distributed.tensor",
    ),
    "lazy models to parallel": (
        f"{MEGACORE}/models/rope.py",
        "def _planted():\n    from megacore.parallel.layout import place",
        "models",
        "megacore.parallel.layout",
    ),
    "lazy torch": (
        f"{MEGACORE}/planner/memory.py",
        "def _planted():\n    import torch.nn",
        "no torch",
        "torch.nn",
    ),
    "torch through a package": (
        f"{MEGACORE}/parallel/__init__.py",
        "from megacore.parallel import mesh",
        "no torch",
        "megacore.parallel.mesh -> torch",
    ),
    "tool to tool": (
        "tools/mega-shard/src/mega_shard/reshard.py",
        "from mega_train.run_plan import RunPlan",
        "tools",
        "mega_train.run_plan",
    ),
    "type-only upward": (
        f"{MEGACORE}/data/documents.py",
        "if TYPE_CHECKING:\n    from megacore.checkpoint import CheckpointReader",
        "layers",
        "megacore.checkpoint",
    ),
}


@pytest.mark.parametrize("plant", PLANTS.values(), ids=PLANTS.keys())
def test_planted_violation_is_reported(layers, tmp_path, plant):
    rel, code, rule, words = plant
    _copy_sources(tmp_path)
    before = set(map(str, check(tmp_path, layers)))
    path = tmp_path / rel
    text = path.read_text(encoding="utf-8")
    text = text if text.endswith("\n") else text + "\n"
    # The import is on the last line of the appended code.
    line = text.count("\n") + code.count("\n") + 1
    path.write_text(text + code + "\n", encoding="utf-8")

    new = [v for v in check(tmp_path, layers) if str(v) not in before]
    assert any(
        v.path == Path(rel) and v.line == line and v.rule == rule and words in v.detail for v in new
    ), f"{rule!r} at {rel}:{line} not among the new reports:\n" + "\n".join(map(str, new))


def test_type_only_torch_is_exempt(layers, tmp_path):
    # Blocks under TYPE_CHECKING never run, so torch-freeness (start-up without torch) is untouched.
    _copy_sources(tmp_path)
    path = tmp_path / MEGACORE / "config.py"
    path.write_text(
        path.read_text(encoding="utf-8") + "\nif TYPE_CHECKING:\n    import torch\n", encoding="utf-8"
    )
    assert not [v for v in check(tmp_path, layers) if v.path.name == "config.py"]


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """The circles of the import graph of our modules (Tarjan's strongly connected components of
    more than one module, or a module importing itself). Every import that runs counts, lazy ones
    too; `if TYPE_CHECKING:` ones never run and are left out."""
    graph = {
        name: sorted({i.target for i in m.imports if not i.type_only and i.target in modules} - {name})
        for name, m in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle():
    """No module of libs/ or tools/ imports, directly or through others, one that imports it back:
    each could be read and tested without the other (the trainer and its objectives were such a
    circle)."""
    modules, _ = scan(REPO)
    assert import_cycles(modules) == []


def test_a_planted_circle_is_found():
    a = Module("mega_x.a", Path("a.py"), (Import(1, "mega_x.b", False),))
    b = Module("mega_x.b", Path("b.py"), (Import(1, "mega_x.a", False),))
    typed = Module("mega_x.c", Path("c.py"), (Import(1, "mega_x.a", True),))
    back = Module("mega_x.d", Path("d.py"), (Import(1, "mega_x.c", False),))
    assert import_cycles({m.name: m for m in (a, b, typed, back)}) == [["mega_x.a", "mega_x.b"]]
