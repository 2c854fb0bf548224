"""Property tests of the planner's decisions against brute-force oracles.

* The knapsack planner's provable γ = 0 shortcut (``_can_beat_autoregressive``: can *any*
  draft within the skip budget beat a plain step at α = 1?) equals a brute force over
  every skip set, for random non-uniform per-layer item times, overheads and per-width
  verify costs; and it never refuses a plan that some draft with a real α ≤ 1 would make
  pay. Checked on the helper and through :meth:`KnapsackPlanner.search`, whose
  ``shortcut`` field records the decision.
* TPT is monotone in α: a better-accepted draft is never predicted slower.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from knapspec.costmodels.base import CostModel
from knapspec.planners import knapsack as knapsack_module
from knapspec.planners.dp import layer_groups, single_items
from knapspec.planners.knapsack import KnapsackPlanner, KnapsackPlannerConfig
from knapspec.planners.objective import RoundCosts, grid_search, tokens_per_time
from knapspec.testing import NoParams, examples, planning_context, tiny_engine


class TableCostModel(CostModel):
    """Per-layer item times, an overhead and per-width verify costs from tables (seconds)."""

    config_class = NoParams

    def __init__(
        self, attention: list[float], mlp: list[float], overhead: float, verify: list[float]
    ) -> None:
        self.attention, self.mlp, self._overhead, self.verify = attention, mlp, overhead, verify

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return float(np.mean(self.attention)) if layer is None else self.attention[layer]

    def t_mlp(self, layer: int | None = None) -> float:
        return float(np.mean(self.mlp)) if layer is None else self.mlp[layer]

    def overhead(self, context_length: int) -> float:
        return self._overhead

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return self.verify[min(tokens, len(self.verify)) - 1]


@st.composite
def cost_tables(draw: st.DrawFn, max_layers: int = 4, max_draft: int = 4) -> dict[str, Any]:
    """Item times spread over two orders of magnitude; a full step is the overhead plus
    every item; wider verification costs 1-2.5x a step, unevenly (plateaus and dips)."""
    layers = draw(st.integers(1, max_layers))
    times = st.floats(1e-4, 1e-2)
    attention = draw(st.lists(times, min_size=layers, max_size=layers))
    mlp = draw(st.lists(times, min_size=layers, max_size=layers))
    overhead = draw(st.floats(0.0, 2e-2))
    step = overhead + sum(attention) + sum(mlp)
    factors = draw(st.lists(st.floats(1.0, 2.5), min_size=max_draft, max_size=max_draft))
    return {
        "attention": attention,
        "mlp": mlp,
        "overhead": overhead,
        "verify": [step] + [step * f for f in factors],
        "max_draft": draw(st.integers(1, max_draft)),
    }


def _brute_force_margin(
    model: TableCostModel,
    groups: tuple[tuple[int, ...], ...],
    weights: tuple[int, ...],
    max_budget: int,
    max_draft: int,
    alpha: float | None = 1.0,
    rng: np.random.Generator | None = None,
) -> float:
    """``max over skip sets and γ ≥ 1 of TPT(draft) · step - 1`` (> 0: speculation pays).

    Every subset of DP items whose skipped weight is at most ``max_budget``; the draft
    costs the overhead plus its executed items. ``alpha`` None: a random α per skip set.
    """
    step = model.verify_cost(1, 0)
    best = -np.inf
    for skipped in itertools.product([False, True], repeat=len(groups)):
        if sum(w for w, s in zip(weights, skipped, strict=True) if s) > max_budget:
            continue
        draft = model.overhead(0) + sum(
            model.t_attn(0, item // 2) if item % 2 == 0 else model.t_mlp(item // 2)
            for group, s in zip(groups, skipped, strict=True)
            if not s
            for item in group
        )
        a = alpha if alpha is not None else float(rng.uniform(0, 1))  # type: ignore[union-attr]
        for gamma in range(1, max_draft + 1):
            tpt = tokens_per_time(a, gamma, draft, model.verify_cost(gamma + 1, 0))
            best = max(best, tpt * step - 1.0)
    return float(best)


@settings(max_examples=examples(150), deadline=None)
@given(
    tables=cost_tables(),
    decoupled=st.booleans(),
    weight_seed=st.integers(0, 2**32 - 1),
    budget_fraction=st.floats(0.0, 1.0),
)
def test_the_shortcut_decides_as_a_brute_force_over_every_skip_set(
    tables: dict[str, Any], decoupled: bool, weight_seed: int, budget_fraction: float
) -> None:
    model = TableCostModel(tables["attention"], tables["mlp"], tables["overhead"], tables["verify"])
    layers = len(tables["attention"])
    groups = single_items(2 * layers) if decoupled else layer_groups(layers)
    rng = np.random.default_rng(weight_seed)
    weights = tuple(int(w) for w in rng.integers(1, 4, size=len(groups)))
    max_budget = int(budget_fraction * sum(weights))
    max_draft = tables["max_draft"]
    margin = _brute_force_margin(model, groups, weights, max_budget, max_draft)
    assume(abs(margin) > 1e-9)  # a float tie may go either way
    decision = knapsack_module._can_beat_autoregressive(
        model, groups, weights, max_budget, 0, max_draft
    )
    assert decision == (margin > 0), f"shortcut says {decision}, brute force margin {margin}"
    # Soundness with real acceptance: if some draft pays at random α ≤ 1, the shortcut
    # (α = 1) must not have refused the search.
    if _brute_force_margin(model, groups, weights, max_budget, max_draft, None, rng) > 1e-9:
        assert decision


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return tiny_engine(3)


@settings(max_examples=examples(15), deadline=None)
@given(tables=cost_tables(max_layers=3, max_draft=4))
def test_search_takes_the_shortcut_exactly_when_no_draft_can_pay(
    engine: Any, tables: dict[str, Any]
) -> None:
    """Through the public entry point: ``search(...).shortcut`` against the brute force."""
    layers = engine.num_layers
    # Stretch the drawn tables to the engine's depth (cyclically).
    attention = [tables["attention"][i % len(tables["attention"])] for i in range(layers)]
    mlp = [tables["mlp"][i % len(tables["mlp"])] for i in range(layers)]
    step = tables["overhead"] + sum(attention) + sum(mlp)
    ratio = [v / tables["verify"][0] for v in tables["verify"]]
    model = TableCostModel(attention, mlp, tables["overhead"], [step * r for r in ratio])
    planner = KnapsackPlanner(
        KnapsackPlannerConfig(search_gate="always", max_planning_fraction=None, tau=None)
    )
    context = attrs.evolve(
        planning_context(engine, cost_model=model), max_draft_length=tables["max_draft"]
    )
    search = planner.search(context)
    groups = single_items(2 * layers)
    margin = _brute_force_margin(
        model, groups, search.dp_weights, search.max_budget, tables["max_draft"]
    )
    assume(abs(margin) > 1e-9)
    assert search.shortcut == (margin <= 0), f"shortcut {search.shortcut}, margin {margin}"
    if search.shortcut:
        assert search.plan.draft_length == 0 and search.dp is None


# ------------------------------------------------------------------ TPT is monotone in α
@settings(max_examples=examples(200), deadline=None)
@given(
    low=st.floats(0.0, 1.0),
    high=st.floats(0.0, 1.0),
    gamma=st.integers(0, 12),
    draft=st.floats(0.0, 1.0),
    verify=st.floats(1e-3, 10.0),
    planning=st.floats(0.0, 1.0),
)
def test_tpt_is_monotone_in_alpha(
    low: float, high: float, gamma: int, draft: float, verify: float, planning: float
) -> None:
    low, high = min(low, high), max(low, high)
    slow = tokens_per_time(low, gamma, draft, verify, planning)
    fast = tokens_per_time(high, gamma, draft, verify, planning)
    assert fast >= slow * (1 - 1e-12)
    if gamma >= 1 and high > low + 1e-6:
        assert fast > slow  # E(α, γ) rises strictly in α once anything is drafted


@settings(max_examples=examples(100), deadline=None)
@given(
    alphas=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    bumps=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6),
    draft_seed=st.integers(0, 2**32 - 1),
    verify=st.lists(st.floats(1e-3, 1.0), min_size=2, max_size=8),
)
def test_the_grid_searchs_best_tpt_never_falls_when_acceptance_rises(
    alphas: list[float], bumps: list[float], draft_seed: int, verify: list[float]
) -> None:
    rng = np.random.default_rng(draft_seed)
    costs = RoundCosts(draft=rng.uniform(0, 0.5, len(alphas)), verify=np.array(verify))
    raised = [min(1.0, a + b) for a, b in zip(alphas, bumps, strict=False)]
    before = grid_search(np.array(alphas), costs).objective
    after = grid_search(np.array(raised), costs).objective
    assert after >= before * (1 - 1e-12)
