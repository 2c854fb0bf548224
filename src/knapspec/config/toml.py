"""A TOML writer for the config's flat dict form (the stdlib reads TOML but cannot write it)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from knapspec.config.coercion import ConfigError, describe


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'  # TOML has no null; optional fields read "none" back as None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # repr round-trips exactly and always has a '.' or exponent
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {describe(value)} to TOML")


def to_toml(data: Mapping[str, Any]) -> str:
    """Serialise the flat dict form (scalars, lists, tables and tables of tables) as TOML.

    A tiny writer is enough for this shape (the stdlib reads TOML but cannot write it).
    TOML has no null: None is written as the string ``"none"``, which an optional
    non-string field reads back as None. A table's own keys come before its sub-tables
    (``[drafters.lookup]``), as TOML requires.
    """
    lines: list[str] = []
    _write_table(lines, "", data)
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(lines: list[str], name: str, table: Mapping[str, Any]) -> None:
    tables: list[tuple[str, Mapping[str, Any]]] = []
    values: list[str] = []
    for key, value in table.items():
        if not isinstance(key, str) or not key.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{name or 'config'}: cannot write key {key!r} to TOML")
        if isinstance(value, Mapping):
            tables.append((f"{name}.{key}" if name else key, value))
        else:
            values.append(f"{key} = {_toml_value(value)}")
    # A table holding only sub-tables needs no header of its own ([drafters.lookup]).
    if name and (values or not tables):
        lines += ["", f"[{name}]"]
    lines += values
    for inner_name, inner in tables:
        _write_table(lines, inner_name, inner)


__all__ = ["to_toml"]
