"""``--set KEY=VALUE`` overrides of a :class:`~knapspec.config.schema.DecoderConfig`."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from knapspec.config.coercion import ConfigError
from knapspec.config.schema import COMPONENT_REGISTRIES, DecoderConfig
from knapspec.registry import UnknownComponentError


def parse_override(override: str) -> tuple[list[str], Any]:
    """``"planner.tau=0.6"`` -> ``(["planner", "tau"], 0.6)``.

    Keys are ``FIELD``, ``SECTION.FIELD`` or, for the per-drafter sections,
    ``drafters.NAME.FIELD`` (``drafters.lookup.max_ngram=3``).

    The value is read as a TOML value (``0.6``, ``true``, ``[1, 2]``, ``"text"``); a bare
    word that is not valid TOML (``static``) is taken as a string.

    Raises:
        ConfigError: no ``=``, an empty or malformed key, or a malformed value.
    """
    key, sep, text = override.partition("=")
    key, text = key.strip(), text.strip()
    if not sep:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE (e.g. planner.tau=0.6)")
    parts = key.split(".")
    if not key or any(not part for part in parts) or len(parts) > 3:
        raise ConfigError(
            f"--set {override!r}: bad key {key!r}; use FIELD, SECTION.FIELD or "
            "SECTION.NAME.FIELD (e.g. max_draft_length, planner.tau, drafters.lookup.max_ngram)"
        )
    if not text:
        raise ConfigError(f"--set {override!r}: missing value after '='")
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as error:
        if text[0] in "\"'[{" or not all(c.isalnum() or c in "-_./:" for c in text):
            raise ConfigError(f"--set {override!r}: cannot parse value {text!r}: {error}") from None
        value = text  # a bare word such as a component name
    return parts, value


def _override_order(parts: list[str]) -> int:
    """Sort key of an override's dotted key: the dotted-path switch, names, the rest."""
    if parts == ["allow_dotted_paths"]:
        return 0
    return 1 if len(parts) == 2 and parts[1] == "name" else 2


def apply_overrides(config: DecoderConfig, overrides: Sequence[str]) -> DecoderConfig:
    """A copy of ``config`` with ``--set``-style ``KEY=VALUE`` overrides applied.

    ``allow_dotted_paths`` is applied first (so that a dotted component name given with
    it is legal), then component name changes (``planner.name=static``), which reset that
    component's params to its defaults; the remaining overrides then apply in order, so
    ``["planner.draft_length=3", "planner.name=static"]`` sets static's draft length.
    Fields checked together may change in separate overrides
    (``planner.lookup_match_edges=[1, 4]`` then ``planner.lookup_prior_acceptance=[0.4, 0.7]``):
    only a final config that is still invalid is an error, blamed on the first override
    after which the config was invalid.

    Raises:
        ConfigError: bad syntax, an unknown key, or an invalid value (message quotes the
            override and names the field).
        UnknownComponentError: an unknown component name.
    """
    parsed = [(override, *parse_override(override)) for override in overrides]
    names_first = sorted(parsed, key=lambda item: _override_order(item[1]))
    data = config.to_dict()
    # Each override is checked as it is applied, so an error names the override that
    # caused it; a failure is raised only if the final config fails too, so that fields
    # checked together (one prior per bucket edge) can change in two overrides.
    first_failure: tuple[str, Exception] | None = None
    for override, parts, value in names_first:
        data = _set_key(data, parts, value, override)
        if first_failure is None:
            first_failure = _failure(override, data)
    if first_failure is not None and _failure("", data) is not None:
        override, error = first_failure
        kind = UnknownComponentError if isinstance(error, UnknownComponentError) else ConfigError
        raise kind(f"--set {override!r}: {error}") from error
    return DecoderConfig.from_dict(data)


def _failure(override: str, data: Mapping[str, Any]) -> tuple[str, Exception] | None:
    """``(override, error)`` when ``data`` is not a valid config, else None."""
    try:
        DecoderConfig.from_dict(data)
    except (ConfigError, UnknownComponentError) as error:
        return override, error
    return None


def _set_key(
    data: Mapping[str, Any], parts: list[str], value: Any, override: str, path: str = ""
) -> dict[str, Any]:
    """A copy of ``data`` with the dotted key ``parts`` set to ``value``."""
    result = dict(data)
    head = parts[0]
    where = f"{path}.{head}" if path else head
    if head not in result:
        close = difflib.get_close_matches(head, list(result), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--set {override!r}: unknown key {where!r}; valid: {', '.join(result)}{hint}"
        )
    if len(parts) == 1:
        if isinstance(result[head], Mapping):
            raise ConfigError(
                f"--set {override!r}: {where!r} is a section; set one of its fields "
                f"({where}.FIELD=VALUE)"
            )
        result[head] = value
        return result
    section = result[head]
    if not isinstance(section, Mapping):
        raise ConfigError(f"--set {override!r}: {where!r} is not a section")
    renames = not path and head in COMPONENT_REGISTRIES and parts[1:] == ["name"]
    if renames and value != section.get("name"):
        result[head] = {"name": value}  # another component: its own defaults
        return result
    if len(parts) == 2 and parts[1] not in section and parts[1] != "name":
        result[head] = {**section, parts[1]: value}  # unknown field: from_dict names it
        return result
    result[head] = _set_key(section, parts[1:], value, override, where)
    return result


__all__ = ["apply_overrides", "parse_override"]
