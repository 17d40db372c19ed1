"""Files and functions stay small enough to read: no project file (recipes/, muon/, models/,
scripts/, train.py) over `MAX_FILE_LINES` lines, no function (a method, a nested function)
over `MAX_FUNCTION_LINES` from its `def` to its last line. A file over the size is split along
its purposes; a function over it is cut into named steps, or a table of rows a small loop
renders. `STILL_RESHAPED` names what other changes are reshaping (a file there: its length
and its functions); every entry must still be over a limit, so the list only shrinks.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80
#: files (globs) and functions (`file:Qualified.name`) still being reshaped
STILL_RESHAPED: set[str] = set()


def _files() -> list[Path]:
    packages = ("recipes", "muon", "models", "scripts")
    return sorted([*(p for d in packages for p in (ROOT / d).rglob("*.py")), ROOT / "train.py"])


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in `tree` longer than `limit` lines."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > limit:
                    out.append((name, length))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _over() -> dict[str, int]:
    """Every file and function over its limit, by `file` / `file:name`, with its lines."""
    over = {}
    for path in _files():
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            over[rel] = n
        for name, n in long_functions(ast.parse(text, rel), MAX_FUNCTION_LINES):
            over[f"{rel}:{name}"] = n
    return over


def covers(entry: str, key: str) -> bool:
    """Does `entry` (a file glob: the file and its functions; or `file:name`) cover `key`?"""
    return fnmatch.fnmatch(key, entry) or fnmatch.fnmatch(key.split(":")[0], entry)


def test_no_file_or_function_over_its_size():
    over = _over()
    new = {k: n for k, n in over.items() if not any(covers(e, k) for e in STILL_RESHAPED)}
    assert not new, f"over {MAX_FILE_LINES} lines a file / {MAX_FUNCTION_LINES} a function: {new}"
    stale = [e for e in STILL_RESHAPED if not any(covers(e, k) for k in over)]
    assert not stale, f"STILL_RESHAPED lists what is within the limits now: {stale}"


def test_long_functions_are_found_nested_and_in_classes():
    src = "class A:\n    def f(self):\n        def g():\n" + "            x = 1\n" * 5
    assert long_functions(ast.parse(src), 4) == [("A.f", 7), ("A.f.g", 6)]
    assert long_functions(ast.parse(src), 7) == []
