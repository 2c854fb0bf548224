"""The hidden-state DP against brute force, and the match-rate bookkeeping of
``benchmarks/dp_match_rate.py`` (which measures how often the heuristic is optimal).

Only what must hold is asserted: the DP returns real masks whose score it reports and that
never beat the brute-force optimum; it is exact where that is provable (a budget reached
by a single subset; two DP items, where the only choice is made on the final score); and
the match-rate computation counts matches, misses and gaps correctly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from benchmarks.dp_match_rate import (
    TOLERANCE,
    Instance,
    aggregate,
    best_per_budget,
    brute_force_scores,
    build,
    compare,
    instance_summary,
)
from tests.test_dp import brute_force_best_scores

from knapspec.planners.dp import hidden_state_dp, layer_groups


def instance(
    family: str, num_layers: int, seed: int, weights: tuple[int, ...] | None = None
) -> Instance:
    if weights is None:
        generator = torch.Generator().manual_seed(seed)
        drawn = torch.randint(1, 5, (2 * num_layers,), generator=generator)
        weights = tuple(int(w) for w in drawn)
    return Instance(
        family=family,
        num_layers=num_layers,
        model_seed=seed,
        output_scale=1.0,
        weights=weights,
        context=16,
        window_tokens=4,
        window_seed=seed + 100,
    )


def test_brute_force_table_agrees_with_the_test_dp_oracle() -> None:
    case = instance("llama", 3, 11)
    engine, cache, window = build(case)
    table = brute_force_scores(engine, cache, window, case.weights, case.max_budget)
    chunked = brute_force_scores(engine, cache, window, case.weights, case.max_budget, chunk=5)
    expected_subsets = [
        flags
        for flags in itertools.product((True, False), repeat=case.num_items)
        if sum(w for w, run in zip(case.weights, flags, strict=True) if not run) <= case.max_budget
    ]
    assert set(table) == set(expected_subsets)
    for flags, (budget, score) in table.items():
        assert chunked[flags][0] == budget
        assert chunked[flags][1] == pytest.approx(score, abs=1e-6)
    oracle = brute_force_best_scores(engine, cache, window, list(case.weights), case.max_budget)
    best = best_per_budget(table)
    assert set(best) == set(oracle)
    for budget, score in oracle.items():
        assert best[budget] == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize("min_score", [None, 0.5])
@pytest.mark.parametrize(
    ("family", "num_layers", "seed"), [("llama", 2, 1), ("qwen3", 3, 2), ("llama", 4, 3)]
)
def test_dp_returns_real_masks_that_never_beat_brute_force(
    family: str, num_layers: int, seed: int, min_score: float | None
) -> None:
    case = instance(family, num_layers, seed)
    engine, cache, window = build(case)
    table = brute_force_scores(engine, cache, window, case.weights, case.max_budget)
    best = best_per_budget(table)
    result = hidden_state_dp(
        engine, window, cache, case.weights, max_budget=case.max_budget, min_score=min_score
    )
    assert result.num_candidates > 0
    for budget, flags, score in zip(
        result.budgets, result.table.executed, result.scores.tolist(), strict=True
    ):
        assert table[flags][0] == budget
        # The table entry is the mask's own score, run end to end ...
        assert score == pytest.approx(table[flags][1], abs=1e-5)
        # ... so it can tie the optimum for its budget but never exceed it.
        assert score <= best[budget] + 1e-5
        if min_score is not None:
            assert score >= min_score
    if min_score is None:
        assert set(result.budgets) == set(best)
    comparisons = compare(
        dict(zip(result.budgets, result.table.executed, strict=True)), table, min_score=min_score
    )
    assert all(c.gap is None or c.gap >= -TOLERANCE for c in comparisons)


@pytest.mark.parametrize(("family", "seed"), [("llama", 4), ("qwen3", 5)])
def test_dp_is_exact_on_budgets_reached_by_a_single_subset(family: str, seed: int) -> None:
    case = instance(family, 4, seed)
    engine, cache, window = build(case)
    table = brute_force_scores(engine, cache, window, case.weights, case.max_budget)
    subsets_per_budget: dict[int, int] = {}
    for budget, _ in table.values():
        subsets_per_budget[budget] = subsets_per_budget.get(budget, 0) + 1
    unique = {b for b, count in subsets_per_budget.items() if count == 1}
    assert 0 in unique  # weights >= 1: only the full model skips nothing
    result = hidden_state_dp(
        engine, window, cache, case.weights, max_budget=case.max_budget, min_score=None
    )
    comparisons = compare(dict(zip(result.budgets, result.table.executed, strict=True)), table)
    assert all(c.matched for c in comparisons if c.budget in unique)


@pytest.mark.parametrize(
    ("family", "num_layers", "weights", "grouped"),
    [
        ("llama", 1, (2, 2), False),  # attention vs MLP of one layer, equal weights
        ("qwen3", 1, (1, 3), False),
        ("llama", 2, (3, 3), True),  # two whole layers (CLaSp-like groups)
        ("qwen3", 2, (1, 1), True),
    ],
)
def test_dp_with_two_items_is_exact_for_every_budget(
    family: str, num_layers: int, weights: tuple[int, int], grouped: bool
) -> None:
    """With two DP items, the only competition (two subsets of equal weight) is decided at
    the last item, on the final score itself: the DP is exhaustive."""
    case = instance(family, num_layers, 20 + num_layers)
    engine, cache, window = build(case)
    groups = layer_groups(num_layers) if grouped else None
    budget = sum(weights)
    table = brute_force_scores(engine, cache, window, weights, budget, groups=groups)
    result = hidden_state_dp(
        engine, window, cache, weights, max_budget=budget, groups=groups, min_score=None
    )
    comparisons = compare(dict(zip(result.budgets, result.table.executed, strict=True)), table)
    assert [c.budget for c in comparisons] == sorted({b for b, _ in table.values()})
    assert all(c.matched for c in comparisons)


def test_match_rate_bookkeeping() -> None:
    case = instance("llama", 3, 30)
    engine, cache, window = build(case)
    table = brute_force_scores(engine, cache, window, case.weights, case.max_budget)
    best = best_per_budget(table)
    by_budget: dict[int, list[tuple[tuple[bool, ...], float]]] = {}
    for flags, (budget, score) in table.items():
        by_budget.setdefault(budget, []).append((flags, score))
    argmax = {b: max(entries, key=lambda e: e[1])[0] for b, entries in by_budget.items()}
    argmin = {b: min(entries, key=lambda e: e[1])[0] for b, entries in by_budget.items()}

    # Brute force against itself: every budget matches, with no gap.
    exact = compare(argmax, table)
    summary = instance_summary(exact)
    assert summary["pairs"] == len(best) and summary["matched"] == len(best)
    assert summary["all_matched"] and summary["global_best_matched"]
    assert max(summary["gaps"]) == 0.0
    assert aggregate([summary])["pair_match_rate"] == 1.0

    # A deliberately bad chooser (the worst mask per budget): the rate drops to the share of
    # budgets where the worst mask ties the best one.
    spread = {b: best[b] - min(s for _, s in entries) for b, entries in by_budget.items()}
    assert any(s > TOLERANCE for s in spread.values())  # the check below has power
    worst = instance_summary(compare(argmin, table))
    expected = sum(s <= TOLERANCE for s in spread.values()) / len(spread)
    assert aggregate([worst])["pair_match_rate"] == pytest.approx(expected)
    assert aggregate([worst])["pair_match_rate"] < 1.0 and not worst["all_matched"]
    assert max(worst["gaps"]) == pytest.approx(max(spread.values()))
    skipping = [b for b in best if b > 0]
    assert worst["skipping_best_matched"] == (
        max(best[b] - spread[b] for b in skipping) >= max(best[b] for b in skipping) - TOLERANCE
    )

    # A DP that lost a budget (as τ pruning can make it): a miss, not a match.
    lost = max(best)
    truncated = instance_summary(compare({b: f for b, f in argmax.items() if b != lost}, table))
    assert truncated["missed"] == 1 and truncated["matched"] == len(best) - 1
    assert aggregate([summary, truncated])["pair_match_rate"] == pytest.approx(
        (2 * len(best) - 1) / (2 * len(best))
    )

    # With τ, budgets whose best mask scores below τ are no pairs.
    tau = sorted(best.values())[len(best) // 2]
    pruned = compare({b: f for b, f in argmax.items() if best[b] >= tau}, table, min_score=tau)
    assert [c.budget for c in pruned] == sorted(b for b, s in best.items() if s >= tau)
    assert all(c.matched for c in pruned)

    # A mask that does not weigh its budget is a broken DP, not a mismatch.
    wrong = dict(argmax)
    wrong[0] = argmax[lost]
    with pytest.raises(ValueError, match="skips weight"):
        compare(wrong, table)
    assert math.isfinite(aggregate([summary, worst])["mean_relative_gap"])
