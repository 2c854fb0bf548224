"""Reading settings into attrs records: type checks against the field hints, coercion of
TOML / JSON values (lists to tuples, ``1`` to ``1.0``, ``"none"`` to None), unknown-key
detection with a close-match hint, and the field that made a record's validators fail.

Every error is a :class:`ConfigError` whose message starts with the dotted path of the
offending field (``planner.tau: must be in [-1, 1], got 2``).
"""

from __future__ import annotations

import difflib
import importlib
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names the field (``planner.tau``)."""


def _strip_field_name(message: str, name: str) -> str:
    """``"tau must be in [0, 1]"`` -> ``"must be in [0, 1]"`` (the path already names it)."""
    for prefix in (f"{name} ", f"'{name}' ", f"{name}: "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


_TYPE_HINT_CACHE: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of an attrs class (they are strings under PEP 563), cached."""
    if cls not in _TYPE_HINT_CACHE:
        # sys.modules first: a component defined in a file loaded by path is not importable.
        module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
        try:
            _TYPE_HINT_CACHE[cls] = typing.get_type_hints(cls, globalns=vars(module))
        except Exception:  # an annotation we cannot resolve: skip type checks for this class
            _TYPE_HINT_CACHE[cls] = {}
    return _TYPE_HINT_CACHE[cls]


def _allows(hint: Any, wanted: type) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_allows(arg, wanted) for arg in typing.get_args(hint))
    return hint is wanted


def coerce(value: Any, hint: Any) -> Any:
    """Check ``value`` (from TOML/JSON) against a field's type hint and normalise it.

    TOML writes every list as a list and may write ``1`` for a float; both are converted
    so that ``from_dict(to_dict(c)) == c``. Hints this function does not understand are
    left to the class's own converters and validators.

    Raises:
        TypeError: ``value`` is not of the hinted type (message without the field name).
    """
    if hint is Any or hint is None:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        allows_none = type(None) in args
        if value is None and allows_none:
            return None
        # TOML has no null: "none" spells None for optional non-string fields.
        spells_none = isinstance(value, str) and value.lower() in ("none", "null")
        if allows_none and spells_none and not _allows(hint, str):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except TypeError:
                continue
        raise TypeError(f"expected {_hint_name(hint)}, got {describe(value)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise TypeError(f"must be one of {choices}, got {value!r}")
        return value
    if origin in (tuple, list, Sequence, typing.Sequence):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {describe(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(value)  # fixed-length tuples: leave to the class's validators
        item_hint = args[0] if args else Any
        items = [coerce(item, item_hint) for item in value]
        return tuple(items) if origin is tuple else items
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {describe(value)}")
        return value
    return value


def _hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "none")


def describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def failing_field(cls: type, kwargs: Mapping[str, Any], error: Exception) -> tuple[str, str]:
    """Which field of ``cls`` made construction fail, and why (message sans field name).

    attrs validators do not say which field raised, so each given field's converter and
    validator is re-run alone; the first one that fails is the culprit. A failure no
    single field reproduces (a cross-field check) is reported against the whole section.
    """
    for field in attrs.fields(cls):
        if field.name not in kwargs:
            continue
        value = kwargs[field.name]
        try:
            if field.converter is not None:
                value = field.converter(value)
            if field.validator is not None:
                field.validator(None, field, value)
        except (ValueError, TypeError) as field_error:
            return field.name, _strip_field_name(str(field_error), field.name)
        except Exception:  # a validator that needs the instance; cannot test it alone
            continue
    # A cross-field check whose message starts with the field it blames.
    message = str(error)
    for field in attrs.fields(cls):
        if field.name in kwargs and message.startswith(f"{field.name} "):
            return field.name, _strip_field_name(message, field.name)
    return "", message


def check_keys(data: Mapping[str, Any], valid: Iterable[str], path: str) -> None:
    valid = list(valid)
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: keys must be strings, got {key!r}")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            where = f"{path}.{key}" if path else key
            raise ConfigError(
                f"{where}: unknown key; valid keys here: {', '.join(valid) or '(none)'}{hint}"
            )


def build_attrs(cls: type, data: Mapping[str, Any], path: str) -> Any:
    """Build the attrs class ``cls`` from a mapping, naming the bad field on any error.

    Args:
        cls: an attrs class (a component's ``config_class``, :class:`SamplingParams`, ...).
        data: field name -> value, as read from TOML/JSON (lists for tuples).
        path: dotted prefix for error messages (``"planner"``).

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value its validator
            rejects; the message starts with ``path.field:``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a table of settings, got {describe(data)}")
    fields = {field.name: field for field in attrs.fields(cls) if field.init}
    check_keys(data, fields, path)
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        try:
            kwargs[name] = coerce(value, hints.get(name, Any))
        except TypeError as error:
            raise ConfigError(f"{path}.{name}: {error}") from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        name, reason = failing_field(cls, kwargs, error)
        where = f"{path}.{name}" if name else path
        raise ConfigError(f"{where}: {reason}") from error


def plain_data(value: Any) -> Any:
    """attrs instance / tuple -> JSON- and TOML-friendly dicts and lists."""
    if attrs.has(type(value)):
        return {f.name: plain_data(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    return value


__all__ = [
    "ConfigError",
    "build_attrs",
    "check_keys",
    "coerce",
    "describe",
    "failing_field",
    "plain_data",
    "type_hints",
]
