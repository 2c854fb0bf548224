"""The generic registry: register, look up, list, unknown names, dotted paths."""

from __future__ import annotations

import pytest

from knapspec.config import load_builtin_components
from knapspec.costmodels.base import COST_MODELS
from knapspec.planners.base import PLANNERS
from knapspec.proxies.base import PROXIES
from knapspec.registry import Registry, UnknownComponentError


class Alpha:
    pass


class Beta:
    pass


def test_register_get_names_and_contains() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("Alpha")(Alpha)
    registry.register("beta-two")(Beta)
    assert registry.get("alpha") is Alpha
    assert registry.get("ALPHA") is Alpha  # names are case-insensitive
    assert registry.names() == ["alpha", "beta-two"]
    assert list(registry) == ["alpha", "beta-two"]
    assert "beta-two" in registry and "gamma" not in registry and 3 not in registry
    assert Alpha.registered_name == "alpha"  # type: ignore[attr-defined]


def test_unknown_name_lists_valid_names_and_closest_match() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("knapsack")(Alpha)
    registry.register("static")(Beta)
    with pytest.raises(UnknownComponentError) as info:
        registry.get("knapsak")
    message = str(info.value)
    assert "unknown widget 'knapsak'" in message
    assert "valid names: knapsack, static" in message
    assert "did you mean 'knapsack'?" in message
    assert isinstance(info.value, KeyError)


def test_unknown_name_without_a_close_match_has_no_hint() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("knapsack")(Alpha)
    with pytest.raises(UnknownComponentError, match=r"valid names: knapsack$"):
        registry.get("zzzzzz")


def test_duplicate_registration_is_refused_but_re_registration_is_idempotent() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("alpha")(Alpha)
    registry.register("alpha")(Alpha)  # same class again: fine (module reloads)
    with pytest.raises(ValueError, match="already registered to Alpha"):
        registry.register("alpha")(Beta)


def test_unregister_removes_the_name() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("alpha")(Alpha)
    registry.unregister("ALPHA")
    assert "alpha" not in registry
    registry.unregister("alpha")  # absent: no error


def test_dotted_paths_only_when_allowed() -> None:
    registry: Registry[object] = Registry("widget")
    dotted = f"{__name__}:Beta"
    with pytest.raises(UnknownComponentError):
        registry.get(dotted)
    assert registry.get(dotted, allow_dotted=True) is Beta
    assert registry.get(f"{__name__}.Beta", allow_dotted=True) is Beta
    with pytest.raises(UnknownComponentError, match="cannot import"):
        registry.get("no_such_module_xyz:Thing", allow_dotted=True)
    with pytest.raises(UnknownComponentError, match="is not a class"):
        registry.get("os.path:sep", allow_dotted=True)


def test_builtins_are_registered_with_config_classes() -> None:
    load_builtin_components()
    assert {"static", "early-exit", "autoregressive"} <= set(PLANNERS.names())
    for registry in (PLANNERS, COST_MODELS, PROXIES):
        for name in registry.names():
            cls = registry.get(name)
            assert cls.registered_name == name
            # The contract config.py relies on: an attrs config class with defaults.
            cls.config_class()
