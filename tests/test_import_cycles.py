"""No import cycle inside ``src/knapspec``.

Every module's source is parsed and each import becomes an edge to the most specific
knapspec module it names (``from knapspec.a import b`` -> ``knapspec.a.b`` when that is a
module, else ``knapspec.a``). Every import statement counts: one inside a function (a lazy
import that closes a cycle is still a cycle in the design) and one under ``if
TYPE_CHECKING:`` (it never runs, but the two modules still know each other: a type that
both need belongs in a module below them), as do ``importlib.import_module("knapspec...")``
calls with a literal name. A cycle is a strongly connected component of more than one
module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent


def _module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST) -> list[str]:
    """Dotted names each import statement (or literal import_module) refers to."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    """``module -> knapspec modules it imports`` for every module of the package."""
    modules = _module_files()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = {resolve(name) for name in _imported_names(tree)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walker_sees_lazy_type_checking_and_string_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from knapspec.hidden import X\n"
        "def f():\n    from knapspec.lazy import y\n"
        "    importlib.import_module('knapspec.by_name')\n"
    )
    names = _imported_names(tree)
    assert {"knapspec.lazy.y", "knapspec.by_name", "knapspec.hidden.X"} <= set(names)


def test_every_module_is_walked() -> None:
    graph = import_graph()
    assert "knapspec.decoding.decoder" in graph and "knapspec.cli" in graph
    assert "knapspec.config.schema" in graph["knapspec.config.files"]


def test_no_import_cycle_in_the_package() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
