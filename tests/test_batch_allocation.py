"""The vectorised lookup allocation (:mod:`knapspec.planners.batch.allocation`) against the
step-by-step loop it replaced, kept here as the oracle: for random batches, caps, cost
curves and calibrations both return the same tokens per second, bitwise, and the same γ."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.planners.batch.allocation import (
    ANCHOR_ROWS,
    FloatArray,
    best_lookup_allocation,
    best_lookup_allocations,
    greedy_order,
    lookup_bound,
)
from knapspec.planners.batch.pricing import BatchPassCalibration, RoundPrices
from knapspec.planners.objective import chained_expected_tokens
from knapspec.testing import VerifyCurveCostModel


def _loop_gammas(count: int, taken: Sequence[tuple[float, int]]) -> list[int]:
    gammas = [0] * count
    for _, row in taken:
        gammas[row] += 1
    return gammas


def loop_allocation(
    gains: Sequence[FloatArray], lengths: Sequence[int], cap: int, prices: RoundPrices
) -> tuple[float, list[int]]:
    """The search one candidate at a time (the implementation before NumPy)."""
    count = len(gains)
    increments = sorted(
        (
            (float(gain[k] - gain[k - 1]), row)
            for row, (gain, length) in enumerate(zip(gains, lengths, strict=True))
            for k in range(1, min(cap, length) + 1)
        ),
        key=lambda item: -item[0],
    )
    counts = [0] * count
    tokens, widest = float(count), 0
    best_tpt, best_m = tokens / prices.round(count, 1, 0), 0
    attended = count * prices.attention(1)
    for m, (increment, row) in enumerate(increments, start=1):
        tokens += increment
        attended += prices.attention(counts[row] + 2) - prices.attention(counts[row] + 1)
        counts[row] += 1
        widest = max(widest, counts[row])
        tpt = tokens / prices.round(count + m, 1 + widest, 0, attended)
        if tpt > best_tpt:
            best_tpt, best_m = tpt, m
    gammas = [0] * count
    for _, row in increments[:best_m]:
        gammas[row] += 1
    prefix = [
        float(gain[cap] - gain[0]) if length >= cap else -1.0
        for gain, length in zip(gains, lengths, strict=True)
    ]
    anchors = sorted(range(count), key=lambda row: -prefix[row])[:ANCHOR_ROWS]
    for anchor in anchors:
        if prefix[anchor] < 0.0:
            break
        tokens = count + prefix[anchor]
        attended = count * prices.attention(1) + (prices.attention(cap + 1) - prices.attention(1))
        taken = [(0.0, anchor)] * cap
        tpt = tokens / prices.round(count + cap, 1 + cap, 0, attended)
        if tpt > best_tpt:
            best_tpt, gammas = tpt, _loop_gammas(count, taken)
        others = [item for item in increments if item[1] != anchor]
        counts = [0] * count
        for increment, row in others:
            tokens += increment
            attended += prices.attention(counts[row] + 2) - prices.attention(counts[row] + 1)
            counts[row] += 1
            taken.append((increment, row))
            tpt = tokens / prices.round(count + len(taken), 1 + cap, 0, attended)
            if tpt > best_tpt:
                best_tpt, gammas = tpt, _loop_gammas(count, taken)
    return best_tpt, gammas


Search = tuple[list[FloatArray], list[int], Callable[[], RoundPrices]]


@st.composite
def searches(draw: st.DrawFn) -> Search:
    """A random batch (per row, its acceptance rates), a cost curve linear in tokens and
    context, a calibration, and a maker of fresh round prices for them."""
    rates = draw(
        st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=10), min_size=1, max_size=16)
    )
    per_token = draw(st.floats(0.0, 0.3))
    per_context = draw(st.floats(0.0, 0.01))
    context = draw(st.integers(1, 4000))
    calibrated = draw(
        st.lists(
            st.tuples(st.integers(1, 12), st.integers(1, 200), st.floats(0.5, 3.0)), max_size=6
        )
    )

    class Costs(VerifyCurveCostModel):
        def verify_cost(self, tokens: int, context_length: int) -> float:
            return 1.0 + per_token * (tokens - 1) + per_context * tokens * context_length

    costs = Costs(lambda tokens: 1.0)
    calibration = BatchPassCalibration()
    for rows, tokens, ratio in calibrated:
        calibration.observe(tokens, predicted=1.0, seconds=ratio, rows=rows)

    def prices() -> RoundPrices:
        return RoundPrices(costs, len(rates), context, calibration, BatchPassCalibration(), None)

    return [chained_expected_tokens(row) for row in rates], [len(row) for row in rates], prices


@settings(max_examples=200, deadline=None)
@given(search=searches(), cap=st.integers(1, 10), extra_cap=st.integers(0, 5))
def test_the_vectorised_search_is_the_loop_bitwise(
    search: Search, cap: int, extra_cap: int
) -> None:
    gains, lengths, prices = search
    expected = loop_allocation(gains, lengths, cap, prices())
    got = best_lookup_allocation(gains, lengths, cap, prices())
    # the policy sorts once for its largest cap and hands the order to every cap
    wider = greedy_order(gains, lengths, cap + extra_cap)
    assert best_lookup_allocation(gains, lengths, cap, prices(), wider) == got
    assert got[1] == expected[1]
    assert got[0] == expected[0] or (math.isnan(got[0]) and math.isnan(expected[0]))
    assert all(0 <= g <= min(cap, n) for g, n in zip(got[1], lengths, strict=True))
    assert isinstance(got[0], float) and np.isfinite(got[0])
    # The bound the policy skips the search with is one: no allocation beats it.
    assert lookup_bound(len(gains), wider, prices()) >= got[0] * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(search=searches(), caps=st.integers(1, 12), extra_cap=st.integers(0, 3))
def test_every_cap_at_once_is_each_cap_alone_bitwise(
    search: Search, caps: int, extra_cap: int
) -> None:
    """What the policy runs (one pass over all caps) against the per-cap search above,
    itself the loop's: the same tokens per second, bitwise, and the same γ, every cap."""
    gains, lengths, prices = search
    wider = greedy_order(gains, lengths, caps + extra_cap)
    together = best_lookup_allocations(gains, lengths, caps, prices(), wider)
    assert together == best_lookup_allocations(gains, lengths, caps, prices())
    assert len(together) == caps
    for cap, got in enumerate(together, start=1):
        alone = best_lookup_allocation(gains, lengths, cap, prices(), wider)
        assert got[1] == alone[1], cap
        assert got[0] == alone[0] or (math.isnan(got[0]) and math.isnan(alone[0])), cap
