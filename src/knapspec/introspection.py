"""Field tables for the docs: every config field with its default and its description.

Drawn from the attrs metadata and the ``Attributes:`` sections of the docstrings;
``docs/configuration.md`` is checked against it (``tests/test_config.py``). Only the docs
tooling and its tests import this module.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from knapspec.config.coercion import plain_data
from knapspec.config.schema import (
    COMPONENT_REGISTRIES,
    ComponentConfig,
    ComponentKind,
    DecoderConfig,
    load_builtin_components,
)
from knapspec.drafters.base import DRAFTERS
from knapspec.registry import Registry
from knapspec.sampling import SamplingParams


def describe_fields() -> list[tuple[str, str, str]]:
    """``(key, default, description)`` for every decoder-level and sampling field.

    Drawn from the attrs metadata and the ``Attributes:`` sections of the docstrings;
    ``docs/configuration.md`` is checked against it.
    """
    rows: list[tuple[str, str, str]] = []
    for prefix, cls in (("", DecoderConfig), ("sampling.", SamplingParams)):
        docs = attribute_docs(cls)
        for field in attrs.fields(cls):
            if prefix == "" and field.name in ("sampling", "drafters"):
                continue
            rows.append((prefix + field.name, _default_text(field), docs.get(field.name, "")))
    return rows


def component_fields(kind: ComponentKind) -> dict[str, list[tuple[str, str, str]]]:
    """For every registered component of ``kind``: its ``(field, default, doc)`` rows."""
    return _registry_fields(COMPONENT_REGISTRIES[kind])


def drafter_fields() -> dict[str, list[tuple[str, str, str]]]:
    """For every registered drafter: the ``(field, default, doc)`` rows of its
    ``[drafters.NAME]`` section."""
    return _registry_fields(DRAFTERS)


def _registry_fields(registry: Registry[Any]) -> dict[str, list[tuple[str, str, str]]]:
    load_builtin_components()
    result: dict[str, list[tuple[str, str, str]]] = {}
    for name in registry.names():
        config_class = registry.get(name).config_class
        docs = attribute_docs(config_class)
        result[name] = [
            (field.name, _default_text(field), docs.get(field.name, ""))
            for field in attrs.fields(config_class)
        ]
    return result


def _default_text(field: attrs.Attribute[Any]) -> str:
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    if attrs.has(type(default)):
        if isinstance(default, ComponentConfig):
            return repr(default.name)
        return type(default).__name__ + "()"
    if default is attrs.NOTHING:
        return "(required)"
    return json.dumps(plain_data(default))


def attribute_docs(cls: type) -> dict[str, str]:
    """Field descriptions from a Google-style ``Attributes:`` docstring section.

    ``a, b: text`` documents both fields; continuation lines are joined.
    """
    doc = cls.__doc__ or ""
    lines = doc.splitlines()
    docs: dict[str, str] = {}
    inside = False
    current: list[str] = []
    pending: list[str] = []
    indent = None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside, indent = True, None
            continue
        if not inside:
            continue
        if not stripped:
            if current:
                current = []
            continue
        this_indent = len(line) - len(line.lstrip())
        if indent is None:
            indent = this_indent
        if this_indent < indent:
            break
        if this_indent == indent and ":" not in stripped and stripped.endswith(","):
            pending += [n.strip() for n in stripped.split(",") if n.strip()]
            continue  # a list of names that goes on on the next line
        if this_indent == indent and ":" in stripped:
            names, _, text = stripped.partition(":")
            current = pending + [n.strip() for n in names.split(",")]
            pending = []
            for name in current:
                docs[name] = text.strip()
        elif current:
            for name in current:
                docs[name] = f"{docs[name]} {stripped}".strip()
    return docs


__all__ = ["attribute_docs", "component_fields", "describe_fields", "drafter_fields"]
