"""The batched knapsack DP: exact for additive values (vs brute force), consistent for the
hidden-state value on tiny random Llama models, read-only on the cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec import testing
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.dp import (
    additive_knapsack,
    half_budget,
    hidden_state_dp,
    layer_groups,
    mean_cosine,
    trim_window,
)
from knapspec.testing import examples
from knapspec.window import ReferenceWindow


def brute_force_additive(
    weights: list[int], values: list[float], max_budget: int
) -> dict[int, float]:
    """Best executed value for every exactly-reachable skipped weight <= max_budget."""
    best: dict[int, float] = {}
    for skipped in itertools.product((False, True), repeat=len(weights)):
        budget = sum(w for w, s in zip(weights, skipped, strict=True) if s)
        if budget > max_budget:
            continue
        value = sum(v for v, s in zip(values, skipped, strict=True) if not s)
        best[budget] = max(best.get(budget, float("-inf")), value)
    return best


instances = st.integers(min_value=1, max_value=9).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
        st.lists(st.floats(-10, 10, allow_nan=False, allow_infinity=False), min_size=n, max_size=n),
        st.integers(0, 40),
    )
)


@settings(max_examples=examples(300), deadline=None)
@given(instances)
def test_additive_dp_equals_brute_force_for_every_budget(
    instance: tuple[list[int], list[float], int],
) -> None:
    weights, values, max_budget = instance
    result = additive_knapsack(weights, values, max_budget)
    oracle = brute_force_additive(weights, values, max_budget)
    assert result.budgets == tuple(sorted(oracle))
    for index, budget in enumerate(result.budgets):
        assert float(result.scores[index]) == pytest.approx(oracle[budget], abs=1e-9)
        executed = result.executed[index]
        # The backtracked selection weighs exactly its budget and achieves the table value.
        assert sum(w for w, run in zip(weights, executed, strict=True) if not run) == budget
        achieved = sum(v for v, run in zip(values, executed, strict=True) if run)
        assert achieved == pytest.approx(oracle[budget], abs=1e-9)


def test_additive_dp_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        additive_knapsack([1, -1], [0.0, 0.0], 2)
    with pytest.raises(ValueError, match="weights but"):
        additive_knapsack([1, 1], [0.0], 2)
    with pytest.raises(ValueError, match="at least one item"):
        additive_knapsack([], [], 2)
    with pytest.raises(ValueError, match="max_budget"):
        additive_knapsack([1], [0.0], -1)


def test_half_budget() -> None:
    assert half_budget([3, 1] * 4) == 8
    assert half_budget([1, 1, 1], 0.5) == 1
    with pytest.raises(ValueError, match="fraction"):
        half_budget([1], 1.5)


# ----------------------------------------------------------------- hidden-state value
def tiny_engine(num_layers: int, seed: int) -> SublayerEngine:
    return testing.tiny_engine(num_layers, seed=seed)


def filled(
    engine: SublayerEngine, length: int, window: int, seed: int
) -> tuple[KVCache, ReferenceWindow]:
    """Prefill ``length`` random tokens; the window is the last ``window`` of them."""
    return testing.random_window(engine, length, window, seed)


def cache_snapshot(cache: KVCache) -> tuple[list[int], list[torch.Tensor]]:
    tensors = [cache.keys(i).clone() for i in range(cache.num_layers)]
    tensors += [cache.values(i).clone() for i in range(cache.num_layers)]
    return list(cache.lengths), tensors


def assert_cache_unchanged(cache: KVCache, before: tuple[list[int], list[torch.Tensor]]) -> None:
    lengths, tensors = cache_snapshot(cache)
    assert lengths == before[0]
    for now, then in zip(tensors, before[1], strict=True):
        assert torch.equal(now, then)


@pytest.mark.parametrize(("num_layers", "seed"), [(2, 0), (3, 1), (4, 2), (5, 3), (6, 4)])
def test_hidden_state_dp_is_consistent_with_teacher_forced_masks(
    num_layers: int, seed: int
) -> None:
    engine = tiny_engine(num_layers, seed)
    cache, window = filled(engine, 24, 6, seed)
    weights = [
        int(w)
        for w in torch.randint(
            1, 4, (engine.num_items,), generator=torch.Generator().manual_seed(seed)
        )
    ]
    max_budget = half_budget(weights)
    before = cache_snapshot(cache)
    result = hidden_state_dp(engine, window, cache, weights, max_budget=max_budget, min_score=None)
    assert_cache_unchanged(cache, before)
    assert result.num_candidates > 0 and result.budgets[0] == 0
    for mask, budget in zip(result.masks, result.budgets, strict=True):
        assert sum(weights[i] for i in mask.skipped) == budget <= max_budget
    recomputed = engine.run_masks(
        list(result.masks), window.points[0], window.positions, cache, window.start
    )
    assert_cache_unchanged(cache, before)
    torch.testing.assert_close(recomputed, result.final_states, atol=1e-4, rtol=1e-4)
    scores = mean_cosine(window.final_hidden, recomputed).double()
    torch.testing.assert_close(scores, result.scores, atol=1e-5, rtol=0)
    # The budget-0 candidate is the full model itself.
    assert result.masks[0].is_full
    assert float(result.scores[0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("num_layers", "seed"), [(3, 5), (5, 6)])
def test_hidden_state_dp_never_beats_brute_force(num_layers: int, seed: int) -> None:
    """Provable: each DP candidate is one of the subsets brute force scores, so it can tie
    the best one but never exceed it (the DP is a heuristic for the cosine value)."""
    engine = tiny_engine(num_layers, seed)
    cache, window = filled(engine, 20, 5, seed)
    weights = [1, 2] * num_layers
    max_budget = half_budget(weights)
    result = hidden_state_dp(engine, window, cache, weights, max_budget=max_budget, min_score=None)
    best = brute_force_best_scores(engine, cache, window, weights, max_budget)
    assert set(result.budgets) == set(best)
    for budget, score in zip(result.budgets, result.scores.tolist(), strict=True):
        assert score <= best[budget] + 1e-5


def brute_force_best_scores(
    engine: SublayerEngine,
    cache: KVCache,
    window: ReferenceWindow,
    weights: list[int],
    max_budget: int,
) -> dict[int, float]:
    """Best mean cosine over every mask per exact skipped weight (teacher-forced)."""
    from knapspec.types import SublayerMask

    masks, budgets = [], []
    for executed in itertools.product((True, False), repeat=engine.num_items):
        budget = sum(w for w, run in zip(weights, executed, strict=True) if not run)
        if budget <= max_budget:
            masks.append(SublayerMask(executed))
            budgets.append(budget)
    final = engine.run_masks(masks, window.points[0], window.positions, cache, window.start)
    scores = mean_cosine(window.final_hidden, final).tolist()
    best: dict[int, float] = {}
    for budget, score in zip(budgets, scores, strict=True):
        best[budget] = max(best.get(budget, float("-inf")), score)
    return best


def test_grouped_items_skip_whole_layers() -> None:
    engine = tiny_engine(4, 7)
    cache, window = filled(engine, 16, 4, 7)
    groups = layer_groups(engine.num_layers)
    result = hidden_state_dp(
        engine, window, cache, [1] * 4, max_budget=2, groups=groups, min_score=None
    )
    assert result.budgets == (0, 1, 2)
    for mask, budget in zip(result.masks, result.budgets, strict=True):
        assert all(mask.attention(layer) == mask.mlp(layer) for layer in range(4))
        assert mask.num_skipped == 2 * budget
    recomputed = engine.run_masks(
        list(result.masks), window.points[0], window.positions, cache, window.start
    )
    torch.testing.assert_close(
        mean_cosine(window.final_hidden, recomputed).double(), result.scores, atol=1e-5, rtol=0
    )


def test_pruning_drops_states_below_tau() -> None:
    engine = tiny_engine(3, 8)
    cache, window = filled(engine, 16, 4, 8)
    free = hidden_state_dp(engine, window, cache, [1] * 6, max_budget=3, min_score=None)
    strict = hidden_state_dp(
        engine, window, cache, [1] * 6, max_budget=3, min_score=float(free.scores.min()) + 1e-3
    )
    assert strict.table.stats.pruned_states > 0
    assert bool((strict.scores >= float(free.scores.min()) + 1e-3).all())


def test_trim_window_keeps_the_last_tokens() -> None:
    engine = tiny_engine(2, 9)
    cache, window = filled(engine, 12, 6, 9)
    trimmed = trim_window(window, 2)
    assert trimmed.size == 2 and trimmed.start == window.start + 4
    assert torch.equal(trimmed.points, window.points[:, -2:])
    assert trim_window(window, None) is window
    result = hidden_state_dp(engine, window, cache, [1] * 4, max_budget=2, max_window_tokens=2)
    assert result.final_states.shape[1] == 2 and result.window.start == window.start + 4


def test_hidden_state_dp_rejects_bad_groups_and_weights() -> None:
    engine = tiny_engine(2, 10)
    cache, window = filled(engine, 10, 3, 10)
    with pytest.raises(ValueError, match="groups"):
        hidden_state_dp(engine, window, cache, [1, 1], max_budget=1, groups=((0, 2), (1, 3)))
    with pytest.raises(ValueError, match="weights for"):
        hidden_state_dp(engine, window, cache, [1, 1, 1], max_budget=1)
