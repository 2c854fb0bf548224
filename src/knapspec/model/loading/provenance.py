"""Whether a provisioned model directory is complete: its provenance file and file sizes.

:mod:`knapspec.model.loading.provision` writes ``knapspec-provenance.json`` into the model
directory last, with the size of every other file in it (``files``). A directory is used
only when the provenance file parses and every listed file has its recorded size, so a
directory that lost or truncated a file (a copy interrupted half way, a full disk, a
hand edit) is provisioned again instead of failing to load or, worse, loading. Provenance
files written before sizes were recorded (no ``files``) are trusted as before; a model that
then fails to load is provisioned again by
:func:`~knapspec.model.loading.provision.load_model_and_tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROVENANCE_FILENAME = "knapspec-provenance.json"
"""Written into a provisioned model directory, last; its presence marks the model complete."""

PROVENANCE_SCHEMA = 1
"""Layout version of the provenance file (``files`` is an optional later field)."""

MISSING = "is missing"
"""What :func:`problem` says of a directory with no model at all (not worth a warning)."""


def file_sizes(root: Path) -> dict[str, int]:
    """``{relative path: size in bytes}`` of every file under ``root`` but the provenance."""
    return {
        entry.relative_to(root).as_posix(): entry.stat().st_size
        for entry in sorted(root.rglob("*"))
        if entry.is_file() and entry.name != PROVENANCE_FILENAME
    }


def problem(root: Path) -> str | None:
    """None when ``root`` holds a complete provisioned model, else what is wrong with it
    (:data:`MISSING` when there is nothing there)."""
    provenance_path = root / PROVENANCE_FILENAME
    try:
        if not root.exists() or (not provenance_path.exists() and not any(root.iterdir())):
            return MISSING
    except OSError as error:
        return f"is unreadable ({error})"
    if not provenance_path.is_file():
        return "is incomplete (no provenance file: a provisioning was interrupted)"
    try:
        provenance: Any = json.loads(provenance_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"has an unreadable provenance file ({error!r:.120})"
    if not isinstance(provenance, dict) or provenance.get("schema") != PROVENANCE_SCHEMA:
        return "has a provenance file of another version"
    if not (root / "config.json").is_file():
        return "has no config.json"
    sizes = provenance.get("files")
    if sizes is None:
        return None  # written before sizes were recorded
    if not isinstance(sizes, dict):
        return "has a provenance file of another version"
    for name, size in sizes.items():
        path = root / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"lacks {name}"
        if actual != size:
            return f"has a truncated or altered {name} ({actual} bytes, {size} expected)"
    return None


__all__ = ["MISSING", "PROVENANCE_FILENAME", "PROVENANCE_SCHEMA", "file_sizes", "problem"]
