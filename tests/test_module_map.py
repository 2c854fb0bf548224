"""``docs/architecture.md``'s module map names every module of ``src/knapspec``.

The map is one table (the "Module map" section). A row's first cell is a path under
``src/knapspec/``: a module (``model/engine.py``) or a package (``costmodels/``,
``bench/report/``). A module is on the map when its own row exists, or when a package
row above it names it in backticks in its description: by stem (``base``), or by its
path inside that package (``report/stats``, ``specbench/cli``); a subpackage named as
``report/`` counts for its ``__init__.py``, and a package's own ``__init__.py`` is what
its row describes. Every path in a first cell must exist, so a moved module cannot
leave its row behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent
ARCHITECTURE = PACKAGE_ROOT.parents[1] / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def map_rows(text: str) -> list[tuple[str, str]]:
    """``(first cell's path, description)`` for every row of the Module map's table."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            path = match.group(1).removeprefix("knapspec/")
            rows.append((path, match.group(2)))
    return rows


def modules() -> set[str]:
    """Every module as its path under ``src/knapspec`` (``decoding/run.py``)."""
    return {str(p.relative_to(PACKAGE_ROOT)) for p in PACKAGE_ROOT.rglob("*.py")}


def listed(rows: list[tuple[str, str]], present: set[str]) -> set[str]:
    """The modules of ``present`` that the map's rows name."""
    found: set[str] = set()
    for path, description in rows:
        if not path.endswith("/"):
            found.add(path)
            continue
        found.add(f"{path}__init__.py")
        names = set(re.findall(r"`([\w/]+)`", description))
        for module in present:
            if not module.startswith(path):
                continue
            inner = module.removeprefix(path).removesuffix(".py")
            if inner in names or inner.removesuffix("/__init__") + "/" in names:
                found.add(module)
    return found & present


def test_the_parser_reads_module_and_package_rows() -> None:
    text = (
        "## Module map\n\n| module | responsibility |\n|---|---|\n"
        "| `knapspec/__init__.py` | the API |\n| `model/engine.py` | the engine |\n"
        "| `bench/` | `runner`, `report/` (`report/stats`), a `generate` that is no module |\n"
        "\n## Next\n| `gone.py` | not in the map's section |\n"
    )
    rows = map_rows(text)
    assert [path for path, _ in rows] == ["__init__.py", "model/engine.py", "bench/"]
    present = {
        "__init__.py", "model/engine.py", "model/cache.py", "bench/__init__.py",
        "bench/runner.py", "bench/report/__init__.py", "bench/report/stats.py",
        "bench/report/plots.py", "bench/oracle.py",
    }  # fmt: skip
    assert present - listed(rows, present) == {
        "model/cache.py",
        "bench/report/plots.py",
        "bench/oracle.py",
    }


def test_every_module_is_on_the_map() -> None:
    rows = map_rows(ARCHITECTURE.read_text(encoding="utf-8"))
    present = modules()
    missing = sorted(present - listed(rows, present))
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"


def test_every_row_of_the_map_exists() -> None:
    present = modules()
    packages = {str(Path(m).parent) + "/" for m in present}
    stale = [
        path
        for path, _ in map_rows(ARCHITECTURE.read_text(encoding="utf-8"))
        if path not in present and path not in packages
    ]
    assert not stale, f"rows of docs/architecture.md's module map that name no module: {stale}"
