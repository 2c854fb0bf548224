"""Decoder configuration: attrs frozen records, dict / TOML / JSON forms, ``--set`` overrides.

A :class:`DecoderConfig` names one registered planner, cost model and value proxy, each
with its own validated hyper-parameters (the component's ``config_class``), plus the
decoder's own knobs. Its flat dict form is what the TOML and JSON files hold::

    max_draft_length = 10

    [planner]
    name = "static"          # a registered name (or "pkg.module:Class" when
    skipped_items = [3, 5]   # allow_dotted_paths = true); other keys are its params
    draft_length = 4

    [sampling]
    do_sample = false

Everything here works through the registries (``PLANNERS``, ``COST_MODELS``,
``PROXIES``); no component is special-cased by name. Every error is a :class:`ConfigError`
(a ``ValueError``) whose message starts with the dotted path of the offending field, or the
registry's :class:`~knapspec.registry.UnknownComponentError` (a ``KeyError``) for an
unknown component name.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import math
import os
import pkgutil
import sys
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from knapspec.costmodels.base import COST_MODELS
from knapspec.planners.base import PLANNERS
from knapspec.proxies.base import PROXIES
from knapspec.registry import Registry, UnknownComponentError
from knapspec.sampling import SamplingParams
from knapspec.validators import at_least, unit_interval

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import Planner
    from knapspec.proxies.base import ValueProxy

ComponentKind = Literal["planner", "cost_model", "proxy"]

#: The component sections of a config, each with the registry its names live in.
COMPONENT_REGISTRIES: dict[ComponentKind, Registry[Any]] = {
    "planner": PLANNERS,
    "cost_model": COST_MODELS,
    "proxy": PROXIES,
}

#: Packages whose modules register the built-in components (imported on first use).
_BUILTIN_PACKAGES = ("knapspec.planners", "knapspec.costmodels", "knapspec.proxies")
_builtins_loaded = False


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names the field (``planner.tau``)."""


def load_builtin_components() -> None:
    """Import every module of the planner / cost-model / proxy packages once.

    Built-ins register themselves with a class decorator at import time; importing all
    modules here means a config can name any of them without the caller importing it
    first, and a newly added module is found without editing a list of names.
    """
    global _builtins_loaded
    if _builtins_loaded:
        return
    for package_name in _BUILTIN_PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__, prefix=f"{package_name}."):
            importlib.import_module(module.name)
    _builtins_loaded = True


# ----------------------------------------------------------------- field-level helpers
def _strip_field_name(message: str, name: str) -> str:
    """``"tau must be in [0, 1]"`` -> ``"must be in [0, 1]"`` (the path already names it)."""
    for prefix in (f"{name} ", f"'{name}' ", f"{name}: "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of an attrs class (they are strings under PEP 563), cached."""
    if cls not in _TYPE_HINTS:
        # sys.modules first: a component defined in a file loaded by path is not importable.
        module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
        try:
            _TYPE_HINTS[cls] = typing.get_type_hints(cls, globalns=vars(module))
        except Exception:  # an annotation we cannot resolve: skip type checks for this class
            _TYPE_HINTS[cls] = {}
    return _TYPE_HINTS[cls]


def _allows(hint: Any, wanted: type) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_allows(arg, wanted) for arg in typing.get_args(hint))
    return hint is wanted


def _coerce(value: Any, hint: Any) -> Any:
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
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError(f"expected {_hint_name(hint)}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise TypeError(f"must be one of {choices}, got {value!r}")
        return value
    if origin in (tuple, list, Sequence, typing.Sequence):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {_describe(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(value)  # fixed-length tuples: leave to the class's validators
        item_hint = args[0] if args else Any
        items = [_coerce(item, item_hint) for item in value]
        return tuple(items) if origin is tuple else items
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {_describe(value)}")
        return value
    return value


def _hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "none")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _field_error(cls: type, kwargs: Mapping[str, Any], error: Exception) -> tuple[str, str]:
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
    return "", str(error)


def _check_keys(data: Mapping[str, Any], valid: Iterable[str], path: str) -> None:
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
        raise ConfigError(f"{path}: expected a table of settings, got {_describe(data)}")
    fields = {field.name: field for field in attrs.fields(cls) if field.init}
    _check_keys(data, fields, path)
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        try:
            kwargs[name] = _coerce(value, hints.get(name, Any))
        except TypeError as error:
            raise ConfigError(f"{path}.{name}: {error}") from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        name, reason = _field_error(cls, kwargs, error)
        where = f"{path}.{name}" if name else path
        raise ConfigError(f"{where}: {reason}") from error


def _plain(value: Any) -> Any:
    """attrs instance / tuple -> JSON- and TOML-friendly dicts and lists."""
    if attrs.has(type(value)):
        return {f.name: _plain(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------ components
@attrs.frozen
class ComponentConfig:
    """One component chosen by registry name, with its validated hyper-parameters.

    Attributes:
        name: the registered name (``"knapsack"``, ``"static"``, ...) or, when the
            decoder config sets ``allow_dotted_paths``, an importable
            ``"package.module:ClassName"``.
        params: an instance of the component class's ``config_class``. ``None`` means the
            component's defaults; :class:`DecoderConfig` fills them in, so every component
            inside a decoder config carries a concrete params instance.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    params: Any = None


def _component_class(
    kind: ComponentKind, name: str, *, allow_dotted: bool
) -> tuple[str, type[Any]]:
    """Canonical name and class of component ``name`` of ``kind``."""
    load_builtin_components()
    registry = COMPONENT_REGISTRIES[kind]
    try:
        cls = registry.get(name, allow_dotted=allow_dotted)
    except UnknownComponentError as error:
        note = ""
        if not allow_dotted and ("." in name or ":" in name):
            note = " (dotted import paths need allow_dotted_paths = true)"
        raise UnknownComponentError(f"{kind}.name: {error}{note}") from error
    # A dotted path to a class this registry holds is stored under its registered name.
    registered = getattr(cls, "registered_name", "")
    canonical = registered if registered in registry and registry.get(registered) is cls else name
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not attrs.has(config_class):
        raise ConfigError(
            f"{kind}.name: {cls.__qualname__} ({name!r}) has no attrs config_class, so it "
            "cannot be configured"
        )
    if any(field.name == "name" for field in attrs.fields(config_class)):
        raise ConfigError(
            f"{kind}.name: {config_class.__qualname__} has a field called 'name', which "
            "clashes with the component name key"
        )
    return canonical, config_class


def resolve_component(
    kind: ComponentKind, value: ComponentConfig | str | Mapping[str, Any], *, allow_dotted: bool
) -> ComponentConfig:
    """Normalise a component spec to a :class:`ComponentConfig` with concrete params.

    Accepts a ``ComponentConfig`` (``params`` None = defaults), a bare name, or the dict
    form ``{"name": ..., **params}``.

    Raises:
        UnknownComponentError: the name is not registered (message lists valid names).
        ConfigError: params of the wrong class, unknown keys or invalid values.
    """
    if isinstance(value, str):
        value = ComponentConfig(value)
    elif isinstance(value, Mapping):
        return component_from_dict(kind, value, allow_dotted=allow_dotted)
    if not isinstance(value, ComponentConfig):
        raise ConfigError(
            f"{kind}: expected a ComponentConfig, a name or a table, got {_describe(value)}"
        )
    name, config_class = _component_class(kind, value.name, allow_dotted=allow_dotted)
    params = value.params
    if params is None:
        params = build_attrs(config_class, {}, kind)
    elif type(params) is not config_class:
        raise ConfigError(
            f"{kind}.params: {name!r} takes {config_class.__qualname__}, got "
            f"{type(params).__qualname__}"
        )
    return ComponentConfig(name, params)


def component_from_dict(
    kind: ComponentKind, data: Mapping[str, Any], *, allow_dotted: bool, default_name: str = ""
) -> ComponentConfig:
    """``{"name": "static", "draft_length": 4}`` -> :class:`ComponentConfig`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{kind}: expected a table with a 'name' key, got {_describe(data)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind}.name: expected a component name (string), got {name!r}")
    canonical, config_class = _component_class(kind, name, allow_dotted=allow_dotted)
    params = {key: value for key, value in data.items() if key != "name"}
    return ComponentConfig(canonical, build_attrs(config_class, params, kind))


def component_to_dict(component: ComponentConfig) -> dict[str, Any]:
    """:class:`ComponentConfig` -> ``{"name": ..., **params}``."""
    params = _plain(component.params) if component.params is not None else {}
    return {"name": component.name, **params}


# --------------------------------------------------------------------------- decoder
def _default_component(name: str) -> Any:
    """A field whose default is component ``name`` with its default params."""
    return attrs.field(factory=functools.partial(ComponentConfig, name))


@attrs.frozen
class DecoderConfig:
    """Everything :class:`~knapspec.decoding.decoder.SpeculativeDecoder` needs besides the model.

    Attributes:
        planner: chooses the draft mask and draft length γ each round (registry
            ``PLANNERS``; default ``"knapsack"``).
        cost_model: predicts draft / verify latencies, prices TPT and the knapsack weights
            (registry ``COST_MODELS``; default ``"online"``).
        proxy: scores drafts against the reference window and estimates acceptance α
            (registry ``PROXIES``; default ``"montecarlo"``).
        sampling: greedy or sampled decoding (:class:`~knapspec.sampling.SamplingParams`).
        max_draft_length: D, the largest γ any plan may use (>= 1).
        window_rounds: m, how many recent rounds the reference window keeps (>= 1).
        window_max_tokens: cap on the reference window's tokens r (>= 1); bounds the
            planner's work per plan.
        confidence_threshold: τ_conf in [0, 1]; drafting stops early once the draft's top-1
            probability falls below it (0 = never stop early).
        allow_dotted_paths: let component names be importable ``"package.module:Class"``
            paths of unregistered classes (off by default: a config file then cannot
            import arbitrary code).

    Components given as a bare name, a ``ComponentConfig`` without params or a dict are
    normalised on construction, so equal configs compare equal however they were built.
    """

    planner: ComponentConfig = _default_component("knapsack")  # noqa: RUF009 - attrs field
    cost_model: ComponentConfig = _default_component("online")  # noqa: RUF009
    proxy: ComponentConfig = _default_component("montecarlo")  # noqa: RUF009
    sampling: SamplingParams = attrs.field(
        factory=SamplingParams, validator=attrs.validators.instance_of(SamplingParams)
    )
    max_draft_length: int = attrs.field(default=10, validator=at_least(1))
    window_rounds: int = attrs.field(default=5, validator=at_least(1))
    window_max_tokens: int = attrs.field(default=64, validator=at_least(1))
    confidence_threshold: float = attrs.field(default=0.7, validator=unit_interval)
    allow_dotted_paths: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )

    def __attrs_post_init__(self) -> None:
        # Components are resolved here, not in converters, because a dotted name is only
        # legal when allow_dotted_paths (a later field) is set.
        for kind in COMPONENT_REGISTRIES:
            resolved = resolve_component(
                kind, getattr(self, kind), allow_dotted=self.allow_dotted_paths
            )
            object.__setattr__(self, kind, resolved)

    def component(self, kind: ComponentKind) -> ComponentConfig:
        """The planner, cost model or proxy section by kind name."""
        component: ComponentConfig = getattr(self, kind)
        return component

    def to_dict(self) -> dict[str, Any]:
        """The flat dict form (JSON/TOML-ready): components as ``{"name": ..., **params}``."""
        data: dict[str, Any] = {}
        for field in attrs.fields(DecoderConfig):
            value = getattr(self, field.name)
            data[field.name] = (
                component_to_dict(value) if field.name in COMPONENT_REGISTRIES else _plain(value)
            )
        return data

    def to_toml(self) -> str:
        """The TOML text of :meth:`to_dict`; :func:`load_config` reads it back equal.

        TOML has no null: a None whose field defaults to None is left out (it reloads as
        the default), any other None is written ``"none"``, which optional non-string
        fields read back as None.
        """
        data = self.to_dict()
        sections: dict[str, Any] = {
            kind: self.component(kind).params for kind in COMPONENT_REGISTRIES
        }
        sections["sampling"] = self.sampling
        for key, params in sections.items():
            for field in attrs.fields(type(params)):
                if getattr(params, field.name) is None and field.default is None:
                    del data[key][field.name]
        return to_toml(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderConfig:
        """Build from the flat dict form; missing keys take their defaults.

        A component section without ``name`` uses the default component's name.

        Raises:
            ConfigError: unknown keys or invalid values (message names the field).
            UnknownComponentError: an unknown component name.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a table of settings, got {_describe(data)}")
        fields = {f.name: f for f in attrs.fields(cls)}
        _check_keys(data, fields, "")
        allow_dotted = data.get("allow_dotted_paths", False)
        if not isinstance(allow_dotted, bool):
            raise ConfigError(f"allow_dotted_paths: expected true or false, got {allow_dotted!r}")
        kwargs: dict[str, Any] = {"allow_dotted_paths": allow_dotted}
        for kind in COMPONENT_REGISTRIES:
            if kind in data:
                default_name = _default_component_name(kind)
                kwargs[kind] = component_from_dict(
                    kind, data[kind], allow_dotted=allow_dotted, default_name=default_name
                )
        if "sampling" in data:
            kwargs["sampling"] = build_attrs(SamplingParams, data["sampling"], "sampling")
        hints = _type_hints(cls)
        for name in (
            "max_draft_length",
            "window_rounds",
            "window_max_tokens",
            "confidence_threshold",
        ):
            if name in data:
                try:
                    kwargs[name] = _coerce(data[name], hints.get(name, Any))
                except TypeError as error:
                    raise ConfigError(f"{name}: {error}") from None
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as error:
            name, reason = _field_error(cls, kwargs, error)
            raise ConfigError(f"{name}: {reason}" if name else str(error)) from error


def _default_component_name(kind: ComponentKind) -> str:
    """Name of the component a section without ``name`` gets (the field's default)."""
    field = getattr(attrs.fields(DecoderConfig), kind)
    default: ComponentConfig = field.default.factory()
    return default.name


# ----------------------------------------------------------------------------- files
def load_config(path: str | Path) -> DecoderConfig:
    """Read a ``.toml`` or ``.json`` config file.

    Raises:
        ConfigError: missing or unreadable file, a syntax error (with its line), an
            unsupported extension, or an invalid config.
        UnknownComponentError: an unknown component name.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file ({error.strerror})") from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: invalid JSON: {error}") from None
    try:
        return DecoderConfig.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error.__cause__
    except UnknownComponentError as error:
        raise UnknownComponentError(f"{path}: {error}") from error.__cause__


def save_config(config: DecoderConfig, path: str | Path) -> None:
    """Write ``config`` as ``.toml`` or ``.json`` (by extension); ``load_config`` reads it back.

    See :meth:`DecoderConfig.to_toml` for how None is written to TOML.
    """
    path = Path(path)
    data = config.to_dict()
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    elif suffix == ".toml":
        path.write_text(config.to_toml(), encoding="utf-8")
    else:
        raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .toml or .json")


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
    raise ConfigError(f"cannot write {_describe(value)} to TOML")


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


# ------------------------------------------------------------------------- overrides
def parse_override(override: str) -> tuple[list[str], Any]:
    """``"planner.tau=0.6"`` -> ``(["planner", "tau"], 0.6)``.

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
    if not key or any(not part for part in parts) or len(parts) > 2:
        raise ConfigError(
            f"--set {override!r}: bad key {key!r}; use FIELD or SECTION.FIELD "
            "(e.g. max_draft_length, planner.tau)"
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


def apply_overrides(config: DecoderConfig, overrides: Sequence[str]) -> DecoderConfig:
    """A copy of ``config`` with ``--set``-style ``KEY=VALUE`` overrides applied.

    Component name changes (``planner.name=static``) are applied first and reset that
    component's params to its defaults; the remaining overrides then apply in order, so
    ``["planner.draft_length=3", "planner.name=static"]`` sets static's draft length.

    Raises:
        ConfigError: bad syntax, an unknown key, or an invalid value (message quotes the
            override and names the field).
        UnknownComponentError: an unknown component name.
    """
    parsed = [(override, *parse_override(override)) for override in overrides]
    names_first = sorted(parsed, key=lambda item: not (len(item[1]) == 2 and item[1][1] == "name"))
    data = config.to_dict()
    for override, parts, value in names_first:
        candidate = _set_key(data, parts, value, override)
        try:
            DecoderConfig.from_dict(candidate)
        except ConfigError as error:
            raise ConfigError(f"--set {override!r}: {error}") from error
        except UnknownComponentError as error:
            raise UnknownComponentError(f"--set {override!r}: {error}") from error
        data = candidate
    return DecoderConfig.from_dict(data)


def _set_key(data: dict[str, Any], parts: list[str], value: Any, override: str) -> dict[str, Any]:
    result = dict(data)
    head = parts[0]
    if head not in result:
        close = difflib.get_close_matches(head, list(result), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--set {override!r}: unknown key {head!r}; valid: {', '.join(result)}{hint}"
        )
    if len(parts) == 1:
        if isinstance(result[head], Mapping):
            raise ConfigError(
                f"--set {override!r}: {head!r} is a section; set one of its fields "
                f"({head}.FIELD=VALUE)"
            )
        result[head] = value
        return result
    section = result[head]
    if not isinstance(section, Mapping):
        raise ConfigError(f"--set {override!r}: {head!r} is not a section")
    field = parts[1]
    if head in COMPONENT_REGISTRIES and field == "name" and value != section.get("name"):
        result[head] = {"name": value}  # another component: its own defaults
    else:
        result[head] = {**section, field: value}
    return result


# -------------------------------------------------------------------------- building
def build_components(
    config: DecoderConfig,
    engine: SublayerEngine,
    *,
    build_unused: bool = False,
    planner: Planner | None = None,
    cost_model: CostModel | None = None,
    proxy: ValueProxy | None = None,
) -> tuple[Planner, CostModel | None, ValueProxy | None]:
    """The planner, cost model and proxy for ``engine``'s model: the one component factory.

    A component passed in is used as it is; every other one is looked up in its registry
    by the name ``config`` gives and built with ``from_config(params, engine)``. A planner
    that never reads the reference window (``uses_window`` False: static, early-exit,
    autoregressive) needs neither a cost model nor a proxy; those are then not built
    (returned as passed, usually None) unless ``build_unused``, because building a cost
    model may profile the machine for a few seconds.

    Raises:
        ConfigError: ``from_config`` rejected the params for this model (its
            ``ValueError``, e.g. an exit layer beyond the model's depth), naming the section.
    """
    if planner is None:
        planner = _build(config, "planner", engine)
    if not planner.uses_window and not build_unused:
        return planner, cost_model, proxy
    if cost_model is None:
        cost_model = _build(config, "cost_model", engine)
    if proxy is None:
        proxy = _build(config, "proxy", engine)
    return planner, cost_model, proxy


def as_decoder_config(
    value: DecoderConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
) -> DecoderConfig:
    """A :class:`DecoderConfig` from itself, its dict form, a TOML / JSON file path, or None
    (the defaults).

    Raises:
        ConfigError: an invalid dict or file.
        TypeError: any other type.
    """
    if value is None:
        return DecoderConfig()
    if isinstance(value, DecoderConfig):
        return value
    if isinstance(value, Mapping):
        return DecoderConfig.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        return load_config(Path(value))
    raise TypeError(
        f"config must be a DecoderConfig, a dict or a config file path, got {type(value).__name__}"
    )


def _build(config: DecoderConfig, kind: ComponentKind, engine: SublayerEngine) -> Any:
    component = config.component(kind)
    cls = COMPONENT_REGISTRIES[kind].get(component.name, allow_dotted=config.allow_dotted_paths)
    try:
        return cls.from_config(component.params, engine)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{kind} {component.name!r}: {error}") from error


def describe_fields() -> list[tuple[str, str, str]]:
    """``(key, default, description)`` for every decoder-level and sampling field.

    Drawn from the attrs metadata and the ``Attributes:`` sections of the docstrings;
    ``docs/configuration.md`` is checked against it.
    """
    rows: list[tuple[str, str, str]] = []
    for prefix, cls in (("", DecoderConfig), ("sampling.", SamplingParams)):
        docs = attribute_docs(cls)
        for field in attrs.fields(cls):
            if prefix == "" and field.name == "sampling":
                continue
            rows.append((prefix + field.name, _default_text(field), docs.get(field.name, "")))
    return rows


def component_fields(kind: ComponentKind) -> dict[str, list[tuple[str, str, str]]]:
    """For every registered component of ``kind``: its ``(field, default, doc)`` rows."""
    load_builtin_components()
    result: dict[str, list[tuple[str, str, str]]] = {}
    registry = COMPONENT_REGISTRIES[kind]
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
    return json.dumps(_plain(default))


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


__all__ = [
    "COMPONENT_REGISTRIES",
    "ComponentConfig",
    "ComponentKind",
    "ConfigError",
    "DecoderConfig",
    "apply_overrides",
    "as_decoder_config",
    "attribute_docs",
    "build_attrs",
    "build_components",
    "component_fields",
    "component_from_dict",
    "component_to_dict",
    "describe_fields",
    "load_builtin_components",
    "load_config",
    "parse_override",
    "resolve_component",
    "save_config",
    "to_toml",
]
