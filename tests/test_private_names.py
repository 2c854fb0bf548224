"""No module reaches into another's private names.

A name with one leading underscore is its module's (or its class's) own business: a split
that needs it elsewhere either follows no seam or has found a public interface that wants a
name. The scan parses every module of ``src/knapspec`` and flags ``obj._name`` on anything
but ``self`` / ``cls`` (and ``super()``), and ``from knapspec... import _name``. Attributes
of third-party objects that have no public equivalent are listed with their reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent

#: Private attributes of torch objects the engine needs, each with no public equivalent.
THIRD_PARTY = {
    "_reorder_linear_weight": "torch.ops.mkldnn: oneDNN's weight pre-packing",
    "_linear_pointwise": "torch.ops.mkldnn: oneDNN's packed linear product",
    "_version": "torch.Tensor: the in-place write counter (a stale pre-packed copy)",
    "_parameters": "nn.Module: swapping a weight without re-registering it",
    "_forward_hooks": "nn.Module: refusing to fuse a hooked projection",
    "_forward_pre_hooks": "nn.Module: refusing to fuse a hooked projection",
    "_exit": "os: a server stopped mid-load leaves without tearing down under a C++ thread",
}


def private_reaches(source: str) -> list[str]:
    """``line: expression`` for every private name ``source`` uses from elsewhere."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            if node.attr in THIRD_PARTY:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("knapspec"):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_scan_sees_reaches_and_spares_own_names() -> None:
    source = (
        "from knapspec.x import _hidden\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"
        "        return super()._base(), cls_name.__doc__\n"
    )
    assert sorted(private_reaches(source)) == ["1: import _hidden", "4: other._theirs"]


def test_no_module_uses_another_modules_private_names() -> None:
    reaches = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        found = private_reaches(path.read_text(encoding="utf-8"))
        if found:
            reaches[str(path.relative_to(PACKAGE_ROOT.parent))] = found
    assert not reaches, f"private names used across modules: {reaches}"
