"""Modules stay under about 450 lines; a longer one says why in its docstring.

The reason is a docstring paragraph starting ``Size:`` (see ``docs/architecture.md``,
"Dependencies point one way"), so that a module that grows past the limit is either split
or has its reason read in review.

The limit asks for a seam where a module grows, not for fewer lines by any means: code is
not packed onto one line to stay under it. Two statements never share a line
(``a = 1; b = 2``, ``if x: return y``; a body of ``...`` alone, as the formatter writes
a stub, is fine), and the formatter is not switched off (``# fmt: skip``, ``# fmt: off``)
to keep a call or an import on fewer lines than it would write.
"""

from __future__ import annotations

import ast
import io
import tokenize
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


def _shared_lines(source: str) -> list[int]:
    """Lines on which a statement starts after other code: after a ``;``, or as the body of
    a compound statement written on its header's line (a lone ``...`` stub excepted)."""
    lines = source.encode("utf-8").splitlines()
    shared = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        before = lines[node.lineno - 1][: node.col_offset].strip()
        stub = isinstance(node, ast.Expr) and getattr(node.value, "value", None) is Ellipsis
        if before and not (stub and before.endswith(b":")):
            shared.append(node.lineno)
    return sorted(shared)


def _formatter_switches(source: str) -> list[int]:
    """Lines whose comment switches the formatter off (``# fmt: skip``, ``# fmt: off``)."""
    return [
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
        and token.string.lstrip("#").strip().startswith(("fmt: skip", "fmt: off"))
    ]


def test_the_checks_find_packed_lines() -> None:
    assert _shared_lines("a = 1; b = 2\n") == [1]
    assert _shared_lines("if a:\n    b = 1\nelse: b = 2\n") == [3]
    assert _shared_lines('s = """\nα"""; t = 1\n') == [2]
    assert _shared_lines("def f() -> int: return 1\n") == [1]
    assert _shared_lines("for x in y: pass\n") == [1]
    assert _shared_lines("try:\n    a = 1\nexcept E: a = 2\n") == [3]
    assert _shared_lines("class P:\n    def f(self) -> int: ...\n") == []
    decorated = "@attrs.define\nclass A:\n    x: int = 1\n    if x:\n        y = 2\n"
    assert _shared_lines(decorated) == []
    assert _shared_lines("a = (\n    1\n)\nb = 2\n") == []
    assert _formatter_switches("x = [1,2]  # fmt: skip\n# fmt: off\ny = 1\n") == [1, 2]
    assert _formatter_switches("s = '# fmt: skip'  # a string, not a comment\n") == []


def test_no_code_is_packed_onto_one_line() -> None:
    packed = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = path.relative_to(PACKAGE_ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        packed += [f"{module}:{line}: two statements" for line in _shared_lines(source)]
        packed += [f"{module}:{line}: formatter off" for line in _formatter_switches(source)]
    assert not packed, (
        "code packed onto fewer lines (write one statement a line and let the formatter "
        f"lay it out; a module that outgrows {MAX_LINES} lines splits or says why): {packed}"
    )
