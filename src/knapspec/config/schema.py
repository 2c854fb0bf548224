"""The configuration schema: :class:`DecoderConfig` and its component sections.

A :class:`DecoderConfig` names one registered planner, cost model and value proxy, each
a :class:`ComponentConfig` holding the component's validated hyper-parameters (its
``config_class``), the hyper-parameters of every registered drafter (``drafters``: all of
them are available each round, the planner picks one), plus the decoder's own settings.
Components are looked up through the registries (``PLANNERS``, ``COST_MODELS``,
``PROXIES``, ``DRAFTERS``); none is special-cased by name.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from knapspec.config.coercion import (
    ConfigError,
    build_attrs,
    check_keys,
    coerce,
    describe,
    failing_field,
    plain_data,
    type_hints,
)
from knapspec.config.toml import to_toml
from knapspec.costmodels.base import COST_MODELS
from knapspec.drafters.base import DRAFTERS
from knapspec.planners.base import PLANNERS
from knapspec.proxies.base import PROXIES
from knapspec.registry import Registry, UnknownComponentError
from knapspec.sampling import SamplingParams
from knapspec.validators import at_least, interval, unit_interval

ComponentKind = Literal["planner", "cost_model", "proxy"]

#: The component sections of a config, each with the registry its names live in.
COMPONENT_REGISTRIES: dict[ComponentKind, Registry[Any]] = {
    "planner": PLANNERS,
    "cost_model": COST_MODELS,
    "proxy": PROXIES,
}

#: Packages whose modules register the built-in components (imported on first use).
_BUILTIN_PACKAGES = (
    "knapspec.planners",
    "knapspec.costmodels",
    "knapspec.proxies",
    "knapspec.drafters",
)
_builtins_loaded = False


def load_builtin_components() -> None:
    """Import every module of the planner / cost-model / proxy / drafter packages once.

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
            f"{kind}: expected a ComponentConfig, a name or a table, got {describe(value)}"
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
        raise ConfigError(f"{kind}: expected a table with a 'name' key, got {describe(data)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind}.name: expected a component name (string), got {name!r}")
    canonical, config_class = _component_class(kind, name, allow_dotted=allow_dotted)
    params = {key: value for key, value in data.items() if key != "name"}
    return ComponentConfig(canonical, build_attrs(config_class, params, kind))


def component_to_dict(component: ComponentConfig) -> dict[str, Any]:
    """:class:`ComponentConfig` -> ``{"name": ..., **params}``."""
    params = plain_data(component.params) if component.params is not None else {}
    return {"name": component.name, **params}


# --------------------------------------------------------------------------- drafters
def _drafter_config_class(name: str) -> type[Any]:
    """The ``config_class`` of registered drafter ``name``."""
    load_builtin_components()
    try:
        cls = DRAFTERS.get(name)
    except UnknownComponentError as error:
        raise UnknownComponentError(f"drafters.{name}: {error}") from error
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not attrs.has(config_class):
        raise ConfigError(
            f"drafters.{name}: {cls.__qualname__} has no attrs config_class, so it cannot be "
            "configured"
        )
    return config_class


def resolve_drafters(value: Mapping[str, Any]) -> dict[str, Any]:
    """``{drafter name: params}`` for every registered drafter, sorted by name.

    ``value`` maps registered drafter names to a params instance (the drafter's
    ``config_class``), its table form, or None; a drafter left out gets its defaults.

    Raises:
        UnknownComponentError: a name that is not a registered drafter.
        ConfigError: not a table, params of the wrong class, unknown keys or invalid values
            (the message starts with ``drafters.NAME.FIELD``).
    """
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"drafters: expected a table of drafter name -> settings, got {describe(value)}"
        )
    load_builtin_components()
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(f"drafters: keys must be drafter names, got {name!r}")
        _drafter_config_class(name)
    resolved: dict[str, Any] = {}
    for name in sorted(set(DRAFTERS.names()) | set(value)):
        config_class = _drafter_config_class(name)
        params = value.get(name)
        if params is None:
            params = build_attrs(config_class, {}, f"drafters.{name}")
        elif isinstance(params, Mapping):
            params = build_attrs(config_class, params, f"drafters.{name}")
        elif type(params) is not config_class:
            raise ConfigError(
                f"drafters.{name}: {name!r} takes {config_class.__qualname__}, got "
                f"{type(params).__qualname__}"
            )
        resolved[name] = params
    return resolved


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
        drafters: per registered drafter (registry ``DRAFTERS``), its hyper-parameters
            (``[drafters.lookup]``: the lookup index's n-gram sizes and proposal length);
            a drafter left out keeps its defaults. Which drafter runs each round is the
            planner's choice (``planner.drafters`` for the knapsack planner, which also
            holds the lookup acceptance priors).
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
        prefix_cache_mib: memory budget in MiB of the prompt-prefix cache (0 = off, the
            default): each call keeps its sequence's K/V, and a later prompt that starts
            with the same tokens prefills only the rest (least recently used entries are
            evicted to stay under the budget). Used on an exact engine only, where reuse
            leaves outputs bitwise unchanged.

    Components given as a bare name, a ``ComponentConfig`` without params or a dict are
    normalised on construction, so equal configs compare equal however they were built.
    """

    planner: ComponentConfig = _default_component("knapsack")  # noqa: RUF009 - attrs field
    cost_model: ComponentConfig = _default_component("online")  # noqa: RUF009
    proxy: ComponentConfig = _default_component("montecarlo")  # noqa: RUF009
    drafters: dict[str, Any] = attrs.field(factory=dict, kw_only=True)
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
    prefix_cache_mib: float = attrs.field(
        default=0.0, validator=interval(0.0, math.inf, high_open=True)
    )

    def __attrs_post_init__(self) -> None:
        # Components are resolved here, not in converters, because a dotted name is only
        # legal when allow_dotted_paths (a later field) is set.
        for kind in COMPONENT_REGISTRIES:
            resolved = resolve_component(
                kind, getattr(self, kind), allow_dotted=self.allow_dotted_paths
            )
            object.__setattr__(self, kind, resolved)
        object.__setattr__(self, "drafters", resolve_drafters(self.drafters))

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
                component_to_dict(value)
                if field.name in COMPONENT_REGISTRIES
                else plain_data(value)
            )
        return data

    def params_sections(self) -> dict[str, Any]:
        """Dotted section name -> the attrs params it holds (``"planner"``,
        ``"drafters.lookup"``, ``"sampling"``)."""
        sections: dict[str, Any] = {
            kind: self.component(kind).params for kind in COMPONENT_REGISTRIES
        }
        sections.update({f"drafters.{name}": params for name, params in self.drafters.items()})
        sections["sampling"] = self.sampling
        return sections

    def to_toml(self) -> str:
        """The TOML text of :meth:`to_dict`; :func:`load_config` reads it back equal.

        TOML has no null: a None whose field defaults to None is left out (it reloads as
        the default), any other None is written ``"none"``, which optional non-string
        fields read back as None.
        """
        data = self.to_dict()
        for key, params in self.params_sections().items():
            table = data
            for part in key.split("."):
                table = table[part]
            for field in attrs.fields(type(params)):
                if getattr(params, field.name) is None and field.default is None:
                    del table[field.name]
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
            raise ConfigError(f"config: expected a table of settings, got {describe(data)}")
        fields = {f.name: f for f in attrs.fields(cls)}
        check_keys(data, fields, "")
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
        if "drafters" in data:
            kwargs["drafters"] = resolve_drafters(data["drafters"])
        if "sampling" in data:
            kwargs["sampling"] = build_attrs(SamplingParams, data["sampling"], "sampling")
        hints = type_hints(cls)
        for name in (
            "max_draft_length",
            "window_rounds",
            "window_max_tokens",
            "confidence_threshold",
            "prefix_cache_mib",
        ):
            if name in data:
                try:
                    kwargs[name] = coerce(data[name], hints.get(name, Any))
                except TypeError as error:
                    raise ConfigError(f"{name}: {error}") from None
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as error:
            name, reason = failing_field(cls, kwargs, error)
            raise ConfigError(f"{name}: {reason}" if name else str(error)) from error


def _default_component_name(kind: ComponentKind) -> str:
    """Name of the component a section without ``name`` gets (the field's default)."""
    field = getattr(attrs.fields(DecoderConfig), kind)
    default: ComponentConfig = field.default.factory()
    return default.name


__all__ = [
    "COMPONENT_REGISTRIES",
    "ComponentConfig",
    "ComponentKind",
    "DecoderConfig",
    "component_from_dict",
    "component_to_dict",
    "load_builtin_components",
    "resolve_component",
    "resolve_drafters",
]
