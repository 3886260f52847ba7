"""The house has no circle: refimpl's modules import each other as a tree, and the
product never imports its judge (`conformance`).

Every import statement counts, those inside functions too (a lazy import is still a
dependency), read from the source without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

REFIMPL = Path(__file__).resolve().parent.parent / "refimpl"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "refimpl":
                found |= {f"refimpl.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(REFIMPL.glob("*.py")):
        name = "refimpl" if path.stem == "__init__" else f"refimpl.{path.stem}"
        graph[name] = _imports(path) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle among the modules of `graph`, or None (depth-first, three colours)."""
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if dep not in graph:
                continue
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in graph:
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_refimpl_never_imports_conformance():
    offenders = {m: sorted(d for d in deps if d.split(".")[0] == "conformance")
                 for m, deps in _graph().items()}
    assert not {m: d for m, d in offenders.items() if d}


def test_refimpl_modules_import_no_circle():
    assert _cycle(_graph()) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
