"""The one component factory: a :class:`~knapspec.config.schema.DecoderConfig` (plus any
components given as instances) to the planner, cost model, proxy and proposing drafters
for a model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from knapspec.config.coercion import ConfigError
from knapspec.config.files import load_config
from knapspec.config.schema import COMPONENT_REGISTRIES, ComponentKind, DecoderConfig
from knapspec.drafters.base import DRAFTERS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from knapspec.costmodels.base import CostModel
    from knapspec.drafters.base import Drafter
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import Planner
    from knapspec.proxies.base import ValueProxy


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


def build_drafters(
    config: DecoderConfig,
    engine: SublayerEngine,
    names: Iterable[str],
    *,
    proposers: Iterable[str] = (),
) -> dict[str, Drafter]:
    """The drafters ``names`` (those a planner's plans may name, its ``plan_drafters()``),
    each built from its ``[drafters.NAME]`` params, by name.

    Args:
        proposers: the names the planner reads proposals of before planning (its
            ``proposal_drafters()``); each must declare ``proposes_before_planning``.

    Raises:
        UnknownComponentError: a name that is not a registered drafter.
        ConfigError: a proposer that does not propose before planning (the decoder runs it
            only once a plan chose it), or params ``from_config`` rejected.
    """
    drafters: dict[str, Drafter] = {}
    proposing = set(proposers)
    for name in sorted(set(names) | proposing):
        cls = DRAFTERS.get(name)
        if name in proposing and not cls.proposes_before_planning:
            raise ConfigError(
                f"drafters.{name}: the planner reads proposals of {name!r}, which does not "
                "propose before planning (proposes_before_planning is False)"
            )
        params = config.drafters.get(name)  # None for a drafter registered after the config
        try:
            drafters[name] = cls.from_config(params, engine)
        except ValueError as error:
            raise ConfigError(f"drafters.{name}: {error}") from error
    return drafters


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


__all__ = ["as_decoder_config", "build_components", "build_drafters"]
