"""The component shape: one ``Component`` base, one factory for defaults, shared validators.

Every registered planner and proxy is built through ``from_config`` on a tiny random
Llama and must keep the record it was built from; the decoder must build what it is not
given through ``build_components`` (so the defaults live in ``DecoderConfig`` only).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from tests.test_planners_contract import build_context, tiny_llama_engine
from tests.tiny_models import tiny_model

from knapspec.components import Component
from knapspec.config import (
    COMPONENT_REGISTRIES,
    ConfigError,
    DecoderConfig,
    load_builtin_components,
)
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.planners import AutoregressivePlanner, KnapsackPlanner, StaticPlanner
from knapspec.planners.knapsack import KnapsackPlannerConfig
from knapspec.planners.replan import ReplanConfig
from knapspec.proxies import MonteCarloAcceptanceProxy
from knapspec.proxies.montecarlo import MonteCarloProxyConfig
from knapspec.validators import at_least, cosine, interval, open_unit_interval, optional

load_builtin_components()

BUILDABLE = [
    (kind, name)
    for kind in ("planner", "proxy")
    for name in COMPONENT_REGISTRIES[kind].names()  # type: ignore[index]
]


@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
    return tiny_llama_engine()


def test_every_registered_class_is_a_component() -> None:
    for registry in COMPONENT_REGISTRIES.values():
        for name in registry.names():
            cls = registry.get(name)
            assert issubclass(cls, Component), name
            assert cls.registered_name == name
            assert attrs.has(cls.config_class), name


@pytest.mark.parametrize(("kind", "name"), BUILDABLE)
def test_from_config_keeps_the_record_it_was_built_from(
    kind: str, name: str, engine: SublayerEngine
) -> None:
    cls = COMPONENT_REGISTRIES[kind].get(name)  # type: ignore[index]
    config = cls.config_class()
    component = cls.from_config(config, engine)
    assert isinstance(component, cls)
    assert component.config == config


@pytest.mark.parametrize(("kind", "name"), BUILDABLE)
def test_from_config_refuses_another_record_type(
    kind: str, name: str, engine: SublayerEngine
) -> None:
    cls = COMPONENT_REGISTRIES[kind].get(name)  # type: ignore[index]
    with pytest.raises(TypeError, match=cls.config_class.__name__):
        cls.from_config(ReplanConfig(), engine)


def test_directly_built_components_describe_themselves(engine: SublayerEngine) -> None:
    static = StaticPlanner.from_config(StaticPlanner.config_class((1, 4), 3), engine)
    rebuilt = StaticPlanner(static.mask, static.draft_length)
    assert rebuilt.config == static.config
    assert KnapsackPlanner().config == KnapsackPlannerConfig()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_backoff", -1),
        ("acceptance_smoothing", 1.5),
        ("every_rounds", 0),
        ("max_planning_fraction", 2.0),
        ("context_growth", -0.1),
    ],
)
def test_replan_settings_are_checked_when_a_config_is_loaded(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^planner\.{field}: "):
        DecoderConfig.from_dict({"planner": {"name": "knapsack", field: value}})


def test_replan_settings_share_the_policy_defaults() -> None:
    config = KnapsackPlannerConfig()
    assert config.replan_config() == ReplanConfig()


def test_decoder_builds_only_what_it_is_not_given() -> None:
    model = tiny_model("llama")
    planner = AutoregressivePlanner()
    decoder = SpeculativeDecoder(model, planner=planner, max_draft_length=3)
    assert decoder.planner is planner
    # The planner reads no window: the factory builds no cost model or proxy for it.
    assert decoder.cost_model is None and decoder.proxy is None
    assert decoder.max_draft_length == decoder.config.max_draft_length == 3
    assert decoder.config.window_rounds == DecoderConfig().window_rounds


def test_decoder_takes_a_config_as_its_second_argument() -> None:
    model = tiny_model("llama")
    config = {"planner": {"name": "static", "draft_length": 2}, "confidence_threshold": 0.0}
    decoder = SpeculativeDecoder(model, config)
    assert isinstance(decoder.planner, StaticPlanner)
    assert decoder.planner.draft_length == 2
    assert decoder.confidence_threshold == 0.0
    assert decoder.config == DecoderConfig.from_dict(config)
    overridden = SpeculativeDecoder(model, config, confidence_threshold=0.5)
    assert overridden.config.confidence_threshold == 0.5
    assert overridden.config.planner == decoder.config.planner


def test_decoder_refuses_a_config_of_another_type() -> None:
    with pytest.raises(TypeError, match="config must be a DecoderConfig"):
        SpeculativeDecoder(tiny_model("llama"), 3)  # type: ignore[arg-type]


@attrs.frozen
class _Ranges:
    fraction: float = attrs.field(default=0.5, validator=open_unit_interval)
    threshold: float | None = attrs.field(default=None, validator=optional(cosine))
    count: int = attrs.field(default=1, validator=at_least(1))
    share: float = attrs.field(default=1.0, validator=interval(0.0, 1.0, low_open=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fraction": 1.0}, r"fraction must be in \(0, 1\), got 1.0"),
        ({"threshold": 1.5}, r"threshold must be in \[-1, 1\], got 1.5"),
        ({"count": 0}, "count must be an integer >= 1, got 0"),
        ({"count": True}, "count must be an integer >= 1, got True"),
        ({"share": 0.0}, r"share must be in \(0, 1\], got 0.0"),
        ({"fraction": "half"}, r"fraction must be in \(0, 1\), got 'half'"),
    ],
)
def test_validators_name_the_field_and_the_range(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _Ranges(**kwargs)


def test_validators_accept_in_range_values() -> None:
    assert _Ranges(fraction=0.25, threshold=-1.0, count=7, share=1.0).count == 7


def test_proxies_declare_their_score_range(engine: SublayerEngine) -> None:
    assert MonteCarloAcceptanceProxy().score_range == (-1.0, 1.0)
    neg_kl = MonteCarloAcceptanceProxy.from_config(MonteCarloProxyConfig(score="neg-kl"), engine)
    low, high = neg_kl.score_range
    assert low == float("-inf") and high == 0.0


def test_knapsack_refuses_a_threshold_outside_the_proxy_scale(engine: SublayerEngine) -> None:
    neg_kl = MonteCarloAcceptanceProxy.from_config(MonteCarloProxyConfig(score="neg-kl"), engine)
    context = attrs.evolve(build_context(engine), proxy=neg_kl)
    planner = KnapsackPlanner(KnapsackPlannerConfig(objective="tpl", tau=0.5))
    with pytest.raises(ValueError, match=r"tau=0.5 lies outside the proxy's score range"):
        planner.search(context)
    # tau = None turns pruning off: the same search runs.
    search = KnapsackPlanner(KnapsackPlannerConfig(objective="tpl", tau=None)).search(context)
    assert search.dp is not None and search.dp.num_candidates > 0
