"""The one markdown-table writer every report table goes through."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub markdown table: ``header``, a rule, then one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


__all__ = ["markdown_table"]
