"""The value-proxy contract, checked for every registered proxy (one suite, parametrized).

Every module of ``knapspec.proxies`` is imported first, so a proxy added later is picked up
without editing this file. Each is built with ``cls.from_config(cls.config_class(), engine)``
(plus the cosine proxy's other acceptance modes) on a tiny random Llama whose reference
window comes from a real engine forward, and checked by
:func:`knapspec.testing.check_proxy`, which third-party proxies can call too.
"""

from __future__ import annotations

from typing import Any

import pytest

from knapspec.config import load_builtin_components
from knapspec.model.engine import SublayerEngine
from knapspec.proxies.base import PROXIES, AcceptanceEstimate, ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.testing import (
    TopOneProxy,
    check_proxy,
    check_registration,
    random_window,
    tiny_engine,
)
from knapspec.window import ReferenceWindow

load_builtin_components()

#: Every registered proxy with its defaults, and non-default modes worth the same checks.
CASES: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in sorted(PROXIES.names())] + [
    ("cosine", {"acceptance": "certified"}),
    ("cosine", {"acceptance": "certified-exact"}),
    ("cosine", {"space": "normed"}),
]


@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
    return tiny_engine(4)


@pytest.fixture(scope="module")
def window(engine: SublayerEngine) -> ReferenceWindow:
    return random_window(engine, 40, 12, seed=3)[1]


def build(name: str, params: dict[str, Any], engine: SublayerEngine) -> ValueProxy:
    cls = PROXIES.get(name)
    return cls.from_config(cls.config_class(**params), engine)


def test_the_suite_sees_every_builtin() -> None:
    assert {"cosine", "montecarlo"} <= set(PROXIES.names())


@pytest.mark.parametrize("name", sorted(PROXIES.names()))
def test_registration_contract(name: str, engine: SublayerEngine) -> None:
    check_registration(PROXIES, name, ValueProxy, engine)


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_proxy_contract(
    name: str, params: dict[str, Any], engine: SublayerEngine, window: ReferenceWindow
) -> None:
    check_proxy(build(name, params, engine), engine, window)


def test_the_test_double_keeps_the_contract(
    engine: SublayerEngine, window: ReferenceWindow
) -> None:
    check_proxy(TopOneProxy(), engine, window)


class _BatchDependent(TopOneProxy):
    """Broken on purpose: every branch gets the batch's mean α."""

    def estimate_acceptance(  # type: ignore[no-untyped-def]
        self, engine, window, candidate_final, sampling: SamplingParams
    ) -> list[AcceptanceEstimate]:
        estimates = super().estimate_acceptance(engine, window, candidate_final, sampling)
        mean = sum(e.alpha for e in estimates) / len(estimates)
        return [AcceptanceEstimate(mean, mean, mean, e.samples) for e in estimates]


class _IntervalOutside(TopOneProxy):
    """Broken on purpose: the interval does not contain α."""

    def estimate_acceptance(  # type: ignore[no-untyped-def]
        self, engine, window, candidate_final, sampling: SamplingParams
    ) -> list[AcceptanceEstimate]:
        estimates = super().estimate_acceptance(engine, window, candidate_final, sampling)
        return [AcceptanceEstimate(e.alpha, 0.0, e.alpha / 2, e.samples) for e in estimates]


@pytest.mark.parametrize(
    ("broken", "clause"), [(_BatchDependent, "in a batch"), (_IntervalOutside, "low <= alpha")]
)
def test_the_contract_catches_a_broken_proxy(
    broken: type[ValueProxy], clause: str, engine: SublayerEngine, window: ReferenceWindow
) -> None:
    with pytest.raises(AssertionError, match=clause):
        check_proxy(broken(), engine, window)
