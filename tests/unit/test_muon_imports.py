"""The import graph of muon/: every module imports on its own, and no import circle exists.

The graph is read from the source with `ast` (every `import` / `from ... import` anywhere in a
file, inside functions included, since a lazy import is still an edge), so a circle hidden in a
function body fails here even when importing happens to work.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MUON = ROOT / "muon"
MODULES = sorted("muon" if p.stem == "__init__" else f"muon.{p.stem}" for p in MUON.glob("*.py"))


def _imports(module: str) -> set[str]:
    """The muon modules `module` imports (a name imported from the package that is a
    submodule counts as that submodule; any other name as the package itself)."""
    path = MUON / ("__init__.py" if module == "muon" else f"{module.split('.')[1]}.py")
    package = "muon"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the package
                base = f"{package}.{base}" if base else package
            # `from muon import cost` imports the submodule; `from muon.cost import x` the module
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            parts = t.split(".")
            if parts[0] == "muon":
                name = ".".join(parts[:2])
                out.add(name if name in MODULES else "muon")
    out.discard(module)
    return out


def _graph() -> dict[str, set[str]]:
    return {m: _imports(m) for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


@pytest.mark.parametrize("module", MODULES)
def test_every_muon_module_imports(module):
    importlib.import_module(module)


def test_muon_import_graph_has_no_circle():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert _reaches(graph, "muon.cost") == set(), "muon.cost imports no other muon module"
    # a path object (name, exchange, cost) reads plans by their fields: planning may ask it
    # what a batch costs, and it reaches nothing but the cost model
    assert _reaches(graph, "muon.paths") <= {"muon.cost"}, _reaches(graph, "muon.paths")
    # plans are plain data: planning never reaches the step's code (its phases, update math,
    # census, orthogonalization); it may read Newton-Schulz's tables to validate settings
    step = {"muon.optimizer", "muon.task", "muon.update", "muon.census", "muon.blocks"}
    for plain in ("muon.plan", "muon.planner", "muon.owners"):
        assert not _reaches(graph, plain) & step, (plain, _reaches(graph, plain) & step)
    # the step's modules read what they share with planning from `muon.wire`, never the planner
    assert _reaches(graph, "muon.wire") == set(), _reaches(graph, "muon.wire")
    for part in (
        "muon.task",
        "muon.guard",
        "muon.census",
        "muon.phases",
        "muon.paths",
        "muon.runtime",
    ):
        assert "muon.planner" not in _reaches(graph, part), (part, _reaches(graph, part))


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a lazy import inside a function is an edge too."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    src = "def f():\n    from muon.paths import PATHS\n"
    tree = ast.parse(src)
    found = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found == ["muon.paths"]
