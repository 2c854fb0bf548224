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
    """Serialise the flat dict form (scalars, lists, one level of tables) as TOML.

    A tiny writer is enough for this shape (the stdlib reads TOML but cannot write it).
    TOML has no null: None is written as the string ``"none"``, which an optional
    non-string field reads back as None.
    """
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines.append("")
        lines.append(f"[{key}]")
        for inner_key, inner_value in table.items():
            if isinstance(inner_value, Mapping):
                raise ConfigError(f"{key}.{inner_key}: nested tables are not supported")
            lines.append(f"{inner_key} = {_toml_value(inner_value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


__all__ = ["to_toml"]
