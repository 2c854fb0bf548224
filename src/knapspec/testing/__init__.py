"""Test doubles and contract checks for knapspec components, for this repo and third parties.

A third-party planner, cost model or value proxy can be checked with the same suites the
built-in ones pass (``docs/extending.md``)::

    from knapspec.testing import check_cost_model, check_proxy, tiny_engine

    def test_my_cost_model_keeps_the_contract():
        engine = tiny_engine()
        check_cost_model(MyCostModel.from_config(MyCostModel.config_class(), engine), engine)

What is here:

* tiny random models built in code (:mod:`~knapspec.testing.models`): Llamas
  (:func:`tiny_llama`, :func:`tiny_engine`), with an optional ``layer_damping`` that makes
  deep layers change the residual little, so that layer-skipping drafts are often accepted
  (a model on which speculation happens), and one model per supported family
  (:func:`tiny_model`); reference windows over random tokens (:func:`random_window`);
* cost-model doubles (:mod:`~knapspec.testing.doubles`): :class:`AnalyticCostModel`
  (shaped like the CPU measurements in ``models.md``), :class:`VerifyCurveCostModel` and
  :class:`CheapDraftCostModel`
  (drafting nearly free and verifying any width as cheap as one step: every planner that
  reads costs finds that drafting pays);
* :func:`synthetic_profile`, a latency profile keyed to an engine, for cost models built
  from profiles without timing anything;
* a proxy double, :class:`TopOneProxy`; a planning-context builder, :func:`planning_context`;
* the contract checks (:mod:`~knapspec.testing.contracts`) :func:`check_registration`
  (the component shape, for every registry), :func:`check_cost_model` and
  :func:`check_proxy` (the suites ``tests/test_costmodels_contract.py`` and
  ``tests/test_proxies_contract.py`` run them over every registered component), and
  :func:`examples`, which scales a property test's example count with the active
  hypothesis profile.

Nothing here is imported by the library itself.
"""

from knapspec.testing.contracts import (
    BASE_EXAMPLES,
    check_cost_model,
    check_proxy,
    check_registration,
    examples,
)
from knapspec.testing.doubles import (
    AnalyticCostModel,
    CheapDraftCostModel,
    NoParams,
    TopOneProxy,
    VerifyCurveCostModel,
    synthetic_profile,
)
from knapspec.testing.models import (
    TINY_FAMILY_SHAPE,
    planning_context,
    random_tokens,
    random_window,
    reference_window,
    tiny_engine,
    tiny_llama,
    tiny_model,
)

__all__ = [
    "BASE_EXAMPLES",
    "TINY_FAMILY_SHAPE",
    "AnalyticCostModel",
    "CheapDraftCostModel",
    "NoParams",
    "TopOneProxy",
    "VerifyCurveCostModel",
    "check_cost_model",
    "check_proxy",
    "check_registration",
    "examples",
    "planning_context",
    "random_tokens",
    "random_window",
    "reference_window",
    "synthetic_profile",
    "tiny_engine",
    "tiny_llama",
    "tiny_model",
]
