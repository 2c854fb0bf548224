"""No import cycle inside ``src/knapspec``, and no import that runs up the layer order.

Every module's source is parsed and each import becomes an edge to the most specific
knapspec module it names (``from knapspec.a import b`` -> ``knapspec.a.b`` when that is a
module, else ``knapspec.a``). Every import statement counts: one inside a function (a lazy
import that closes a cycle is still a cycle in the design) and one under ``if
TYPE_CHECKING:`` (it never runs, but the two modules still know each other: a type that
both need belongs in a module below them), as do ``importlib.import_module("knapspec...")``
calls with a literal name. A cycle is a strongly connected component of more than one
module.

The layers (:data:`LAYERS`, bottom first) are declared here, for every top-level module
and package of ``knapspec``: a module may import from its own top-level package or from a
lower layer, never from a higher one or a sibling of its own layer. A new top-level
module fails :func:`test_every_top_level_module_has_a_layer` until it is placed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent

#: The declared layer order of ``knapspec``'s top-level modules and packages, bottom
#: first. Data flows up: engine -> cost model, proxy -> drafters -> planner -> decoder ->
#: the faces over it (package API, integrations, server, measurement, the command).
LAYERS: tuple[tuple[str, ...], ...] = (
    # Base records and helpers, standard library / torch / attrs only.
    ("errors", "paths", "types", "scores", "window", "gumbel", "registry"),
    ("validators", "sampling"),
    ("request",),  # one call's record, handed to the decoding loop
    ("model",),  # the sublayer engine, its kernels and model loading
    ("components",),
    ("costmodels",),
    ("proxies",),
    ("drafters",),
    ("planners",),  # per-request and batch (planners.batch) search
    ("config",),  # builds components by name: above everything it builds
    ("decoding",),
    ("introspection",),
    ("integrations",),  # Hugging Face generate, the vLLM proposer
    ("testing",),  # tiny models and doubles the test suite and docs share
    ("knapspec",),  # the package's public names (knapspec/__init__.py)
    ("commandline",),  # what the command and the bench harness's parsers share
    ("serve",),
    ("bench",),  # the measurement wing (the bench extra)
    ("cli",),  # the command: runs generate, serve and bench
)


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


def _top(module: str) -> str:
    """``knapspec.decoding.run`` -> ``decoding``; the package itself -> ``knapspec``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """``importer -> imported`` for every edge whose target's layer is not below the
    importer's (other than within one top-level package)."""
    rank = {name: index for index, layer in enumerate(layers) for name in layer}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = _top(module), _top(target)
            if here != there and rank[there] >= rank[here]:
                found.append(f"{module} -> {target}")
    return found


def test_the_layer_check_finds_an_upward_and_a_sideways_import() -> None:
    layers = (("a",), ("b", "c"), ("d",))
    graph = {
        "knapspec.d.x": {"knapspec.b.y", "knapspec.a"},
        "knapspec.b.y": {"knapspec.d.x", "knapspec.c.z", "knapspec.b.w"},
        "knapspec.c.z": set(),
        "knapspec.b.w": set(),
        "knapspec.a": set(),
    }
    assert upward_imports(graph, layers) == [
        "knapspec.b.y -> knapspec.c.z",
        "knapspec.b.y -> knapspec.d.x",
    ]


def test_every_top_level_module_has_a_layer() -> None:
    declared = [name for layer in LAYERS for name in layer]
    assert len(declared) == len(set(declared)), "a module is declared on two layers"
    present = {_top(module) for module in import_graph()}
    assert present == set(declared), (
        f"undeclared: {sorted(present - set(declared))}; "
        f"declared but gone: {sorted(set(declared) - present)}"
    )


def test_no_import_runs_up_the_layers() -> None:
    found = upward_imports(import_graph(), LAYERS)
    assert not found, "imports that run up (or sideways) the layer order: " + "; ".join(found)


#: ``knapspec.model``'s wings. ``kernels`` is their floor: it imports only the modules the
#: wings share; the others may import ``kernels``, the engine and its caches, never each
#: other (a newcomer changing how a model loads never meets the tuner, and so on).
MODEL_WINGS = ("kernels", "tuning", "passes", "loading")
MODEL_SHARED = ("knapspec.model.machine", "knapspec.model.cachefiles")


def wing_crossings(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import between ``knapspec.model``'s wings that
    :data:`MODEL_WINGS` does not allow."""

    def wing(module: str) -> str | None:
        parts = module.split(".")
        return (
            parts[2]
            if len(parts) > 2 and parts[:2] == ["knapspec", "model"] and parts[2] in MODEL_WINGS
            else None
        )

    found = []
    for module, targets in sorted(graph.items()):
        here = wing(module)
        if here is None:
            continue
        for target in sorted(t for t in targets if t.startswith("knapspec.model")):
            there = wing(target)
            if there == here:
                continue
            floor_leaves = here == "kernels" and target not in MODEL_SHARED
            sideways = there is not None and there != "kernels"
            if floor_leaves or sideways:
                found.append(f"{module} -> {target}")
    return found


def test_the_model_wings_import_only_the_kernels_and_what_they_share() -> None:
    graph = {
        "knapspec.model.kernels.a": {"knapspec.model.machine", "knapspec.model.cache"},
        "knapspec.model.tuning.b": {"knapspec.model.kernels.a", "knapspec.model.passes.c"},
        "knapspec.model.passes.c": {"knapspec.model.engine", "knapspec.model.kernels.a"},
    }
    assert wing_crossings(graph) == [
        "knapspec.model.kernels.a -> knapspec.model.cache",
        "knapspec.model.tuning.b -> knapspec.model.passes.c",
    ]
    found = wing_crossings(import_graph())
    assert not found, "imports between the model's wings: " + "; ".join(found)
