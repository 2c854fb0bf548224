"""Modules stay under about 450 lines; a longer one says why in its docstring.

The reason is a docstring paragraph starting ``Size:`` (see ``docs/architecture.md``,
"Dependencies point one way"), so that a module that grows past the limit is either split
or has its reason read in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent
MAX_LINES = 450


def _size_reason(source: str) -> str | None:
    """The docstring paragraph that starts with ``Size:``, or None."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    for paragraph in docstring.split("\n\n"):
        if paragraph.lstrip().startswith("Size:"):
            return paragraph.strip()
    return None


def test_the_reason_is_found_only_in_a_size_paragraph() -> None:
    assert _size_reason('"""Title.\n\nSize: one loop read in one place.\n"""\n') is not None
    assert _size_reason('"""Title; size: not a paragraph of its own."""\n') is None
    assert _size_reason("x = 1\n") is None


def test_every_long_module_says_why() -> None:
    unexplained = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.count("\n")
        if lines > MAX_LINES and _size_reason(source) is None:
            unexplained.append(f"{path.relative_to(PACKAGE_ROOT.parent)} ({lines} lines)")
    assert not unexplained, (
        f"modules over {MAX_LINES} lines without a 'Size:' paragraph in their docstring "
        f"(split them or say why): {unexplained}"
    )
