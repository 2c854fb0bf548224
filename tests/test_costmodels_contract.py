"""The cost-model contract, checked for every registered cost model (one suite, parametrized).

Every module of ``knapspec.costmodels`` is imported first, so a cost model added later is
picked up without editing this file. Each is built the way the registry builds it,
``cls.from_config(cls.config_class(), engine)``, with ``$KNAPSPEC_PROFILE`` pointing at a
synthetic profile of the tiny engine (so profile-based models time nothing), and checked
by :func:`knapspec.testing.check_cost_model`, which third-party cost models can call too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from knapspec.config import load_builtin_components
from knapspec.costmodels.base import COST_MODELS, CostModel
from knapspec.costmodels.defaults import PROFILE_ENV
from knapspec.model.engine import SublayerEngine
from knapspec.testing import (
    AnalyticCostModel,
    CheapDraftCostModel,
    check_cost_model,
    check_registration,
    synthetic_profile,
    tiny_engine,
)

load_builtin_components()

COST_MODEL_NAMES = sorted(COST_MODELS.names())


@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
    return tiny_engine(4)


@pytest.fixture
def profile(engine: SublayerEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A synthetic profile of ``engine`` on this machine, named by ``$KNAPSPEC_PROFILE``."""
    path = synthetic_profile(engine).save(tmp_path / "profile.json")
    monkeypatch.setenv(PROFILE_ENV, str(path))
    return path


def build(name: str, engine: SublayerEngine) -> CostModel:
    cls = COST_MODELS.get(name)
    return cls.from_config(cls.config_class(), engine)


def test_the_suite_sees_every_builtin() -> None:
    assert {"linear", "online"} <= set(COST_MODEL_NAMES)


@pytest.mark.parametrize("name", COST_MODEL_NAMES)
def test_registration_contract(name: str, engine: SublayerEngine, profile: Path) -> None:
    check_registration(COST_MODELS, name, CostModel, engine)


@pytest.mark.parametrize("name", COST_MODEL_NAMES)
def test_cost_model_contract(name: str, engine: SublayerEngine, profile: Path) -> None:
    check_cost_model(build(name, engine), engine)


@pytest.mark.parametrize("double", [AnalyticCostModel, CheapDraftCostModel])
def test_the_test_doubles_keep_the_contract(
    double: type[CostModel], engine: SublayerEngine
) -> None:
    check_cost_model(double.from_config(double.config_class(), engine), engine)


class _CheaperWithMoreItems(AnalyticCostModel):
    """Broken on purpose: the overhead is charged per *skipped* item."""

    def draft_cost(self, mask, context_length):  # type: ignore[no-untyped-def]
        return super().draft_cost(mask, context_length) + 0.01 * mask.num_skipped


class _FasterAtLongContext(AnalyticCostModel):
    """Broken on purpose: attention gets cheaper as the context grows."""

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return 1.0 / (1 + context_length)


@pytest.mark.parametrize(
    ("broken", "clause"),
    [(_CheaperWithMoreItems, "draft_cost"), (_FasterAtLongContext, "t_attn fell")],
)
def test_the_contract_catches_a_broken_cost_model(
    broken: type[CostModel], clause: str, engine: SublayerEngine
) -> None:
    with pytest.raises(AssertionError, match=clause):
        check_cost_model(broken.from_config(broken.config_class(), engine), engine)
