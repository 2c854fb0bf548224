"""TPT / tokens-per-layer objectives and the grid search over candidates × γ."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.planners.objective import (
    RoundCosts,
    breakeven_acceptance,
    expected_tokens,
    grid_search,
    tokens_per_layer,
    tokens_per_time,
)
from knapspec.testing import examples
from knapspec.types import SublayerMask

alphas = st.floats(0.0, 1.0, allow_nan=False)
positive = st.floats(1e-4, 1e2, allow_nan=False, allow_infinity=False)


@given(alphas, st.integers(0, 20))
def test_expected_tokens_matches_closed_form(alpha: float, gamma: int) -> None:
    value = float(expected_tokens(alpha, gamma))
    if alpha < 1 - 1e-6:
        assert value == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha), rel=1e-9)
    assert 1.0 <= value <= gamma + 1 + 1e-12


def test_expected_tokens_limits() -> None:
    assert float(expected_tokens(0.0, 7)) == 1.0
    assert float(expected_tokens(1.0, 7)) == 8.0
    assert float(expected_tokens(0.5, 0)) == 1.0
    np.testing.assert_allclose(expected_tokens([0.0, 1.0, 0.5], [3, 3, 1]), [1.0, 4.0, 1.5])
    with pytest.raises(ValueError, match="non-negative integers"):
        expected_tokens(0.5, -1)


def test_gamma_zero_is_one_plain_step() -> None:
    costs = RoundCosts(draft=np.array([0.01, 0.02]), verify=np.array([0.05, 0.08, 0.1]))
    result = grid_search([0.0, 0.0], costs)
    assert result.draft_length == 0 and result.candidate == 0
    assert result.objective == pytest.approx(1 / 0.05)
    assert tokens_per_time(0.3, 0, 0.01, 0.05) == pytest.approx(1 / 0.05)


def monotone_costs(draw: st.DrawFn, candidates: int, max_gamma: int) -> RoundCosts:
    """Verify costs a + b·k (k tokens, a > 0), draft costs >= 0: a realistic cost shape."""
    a, b = draw(positive), draw(st.floats(0, 10))
    draft = np.array([draw(st.floats(0, 10)) for _ in range(candidates)])
    verify = a + b * np.arange(1, max_gamma + 2)
    return RoundCosts(draft=draft, verify=verify, planning=draw(st.floats(0, 1)))


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, RoundCosts]:
    k = draw(st.integers(1, 6))
    d = draw(st.integers(0, 10))
    alpha = np.array([draw(alphas) for _ in range(k)])
    return alpha, monotone_costs(draw, k, d)


@settings(max_examples=examples(200), deadline=None)
@given(problems())
def test_zero_acceptance_never_speculates(problem: tuple[np.ndarray, RoundCosts]) -> None:
    _, costs = problem
    assert grid_search(np.zeros(costs.draft.size), costs).draft_length == 0


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), positive, st.floats(0, 10))
def test_free_perfect_drafts_use_the_longest_draft(k: int, d: int, a: float, b: float) -> None:
    verify = a + b * np.arange(1, d + 2)
    costs = RoundCosts(draft=np.zeros(k), verify=verify)
    # (γ + 1) / (a + b(γ + 1)) strictly increases with γ because a > 0.
    assert grid_search(np.ones(k), costs).draft_length == d


@settings(max_examples=examples(200), deadline=None)
@given(problems(), st.floats(1e-3, 1e3))
def test_scaling_all_costs_keeps_the_best_plan(
    problem: tuple[np.ndarray, RoundCosts], scale: float
) -> None:
    alpha, costs = problem
    scaled = RoundCosts(
        draft=costs.draft * scale, verify=costs.verify * scale, planning=costs.planning * scale
    )
    plain, other = grid_search(alpha, costs), grid_search(alpha, scaled)
    np.testing.assert_allclose(other.table * scale, plain.table, rtol=1e-9)
    # Exact ties may break differently after rounding; the chosen option must be optimal.
    assert plain.table[other.candidate, other.draft_length] == pytest.approx(
        plain.objective, rel=1e-9
    )


@settings(max_examples=examples(100), deadline=None)
@given(problems())
def test_grid_search_returns_the_table_maximum(problem: tuple[np.ndarray, RoundCosts]) -> None:
    alpha, costs = problem
    result = grid_search(alpha, costs)
    assert result.objective == pytest.approx(float(result.table.max()))
    spend = result.draft_length * costs.draft[result.candidate] + costs.verify[result.draft_length]
    spend += costs.planning if result.draft_length else 0.0
    expected = float(expected_tokens(alpha[result.candidate], result.draft_length)) / spend
    assert result.objective == pytest.approx(expected)


def test_no_speculation_can_be_excluded_for_the_ablation() -> None:
    costs = RoundCosts(draft=np.array([1.0]), verify=np.array([1.0, 5.0, 9.0]))
    assert grid_search([0.1], costs).draft_length == 0
    assert grid_search([0.1], costs, allow_no_speculation=False).draft_length == 1


def test_tokens_per_layer_is_grid_search_with_layer_counting() -> None:
    masks = [
        SublayerMask.full(4),
        SublayerMask.early_exit(4, 2),
        SublayerMask.from_skipped(4, [1, 3, 5]),
    ]
    alpha = np.array([0.99, 0.6, 0.8])
    result = grid_search(alpha, RoundCosts.layer_counting(masks, 6))
    executed = np.array([8, 4, 5], dtype=float)
    table = tokens_per_layer(alpha[:, None], np.arange(7)[None, :], executed[:, None], 8.0)
    np.testing.assert_allclose(result.table, table)
    # DEL's closed form for one option.
    assert float(tokens_per_layer(0.6, 3, 2.0, 4.0)) == pytest.approx(
        (1 - 0.6**4) / 0.4 / (3 * 2 + 4)
    )


def test_bad_input_is_named() -> None:
    costs = RoundCosts(draft=np.array([1.0]), verify=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="acceptance rates for"):
        grid_search([0.5, 0.5], costs)
    with pytest.raises(ValueError, match="finite"):
        grid_search([math.nan], costs)
    with pytest.raises(ValueError, match="costs must be"):
        grid_search([0.5], RoundCosts(draft=np.array([1.0]), verify=np.array([0.0, 2.0])))
    with pytest.raises(ValueError, match="at least one"):
        grid_search([], RoundCosts(draft=np.array([]), verify=np.array([1.0])))
    with pytest.raises(ValueError, match="positive"):
        tokens_per_time(0.5, 0, 0.0, 0.0)


@settings(max_examples=examples(200))
@given(
    gamma=st.integers(1, 10),
    draft=st.floats(0.0, 2.0),
    verify=st.floats(0.5, 4.0),
    step=st.floats(0.5, 2.0),
    planning=st.floats(0.0, 0.5),
)
def test_breakeven_acceptance_is_where_speculation_ties_plain_steps(
    gamma: int, draft: float, verify: float, step: float, planning: float
) -> None:
    alpha = breakeven_acceptance(gamma, draft, verify, step, planning)
    assert 0.0 <= alpha <= 1.0
    tpt = lambda a: tokens_per_time(a, gamma, draft, verify, planning)  # noqa: E731
    if 0.0 < alpha < 1.0:
        assert tpt(alpha) == pytest.approx(1.0 / step, rel=1e-9)
    # Below the break-even the round loses to plain steps, above it the round wins.
    if alpha > 1e-6:
        assert tpt(max(0.0, alpha - 1e-3)) < 1.0 / step
    if alpha < 1.0 - 1e-6:
        assert tpt(min(1.0, alpha + 1e-3)) > 1.0 / step


def test_breakeven_acceptance_limits() -> None:
    # A round that costs no more than a plain step pays even at α = 0.
    assert breakeven_acceptance(2, 0.0, 1.0, 1.0) == 0.0
    # Three drafts at a full step each plus a verify of 1.5: 4.5 steps for at most 4 tokens.
    assert breakeven_acceptance(3, 1.0, 1.5, 1.0) == 1.0
    with pytest.raises(ValueError, match="draft_length"):
        breakeven_acceptance(0, 0.1, 1.0, 1.0)
    with pytest.raises(ValueError, match="step_cost"):
        breakeven_acceptance(1, 0.1, 1.0, 0.0)
