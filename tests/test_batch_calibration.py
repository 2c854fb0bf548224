"""What the batch policy learns from the rounds it ran: the price of a pass by its row count
and kind (plain or drafted), and how many of the expected extra tokens its chosen drafts
brought (:class:`DraftRealism`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from knapspec.drafters.base import LOOKUP, Draft
from knapspec.planners.batch.plan import DraftRealism
from knapspec.planners.batch.policy import CostModelBatchPolicy
from knapspec.planners.batch.pricing import BatchPassCalibration, RoundPrices
from knapspec.testing import VerifyCurveCostModel


def test_a_verification_cell_is_its_rows_and_whether_it_drafted() -> None:
    """Plain and drafted passes of one row count keep apart; drafted passes of any width
    share one cell; an unseen cell borrows the nearest (the same row count's other kind
    before another row count's); draft-step sizes (no rows) are another kind."""
    calibration = BatchPassCalibration(window=5)
    calibration.observe(16, predicted=0.030, seconds=0.036, rows=16)  # plain: 1.2
    calibration.observe(31, predicted=0.050, seconds=0.045, rows=16)  # drafted: 0.9
    calibration.observe(24, predicted=0.040, seconds=0.036, rows=16)  # drafted: 0.9
    assert calibration.factor(16, rows=16) == pytest.approx(1.2)
    assert calibration.factor(31, rows=16) == pytest.approx(0.9)
    assert calibration.factor(40, rows=16) == pytest.approx(0.9)  # any drafted width
    assert calibration.ratios == {
        (16, False): pytest.approx(1.2),
        (16, True): pytest.approx(0.9),
    }
    # 15 rows unseen: the nearest cell of its kind (16 rows').
    assert calibration.factor(15, rows=15) == pytest.approx(1.2)
    assert calibration.factor(20, rows=15) == pytest.approx(0.9)
    # 2 rows unseen and far: its own kind 8x away, the other kind as far: its own kind.
    calibration.observe(2, predicted=0.01, seconds=0.011, rows=2)  # plain 2 rows: 1.1
    assert calibration.factor(5, rows=2) == pytest.approx(1.1)  # 16 rows' drafted: too far
    assert calibration.factor(30, rows=12) == pytest.approx(0.9)
    # A count without rows (a draft step's) never borrows a verification cell.
    assert calibration.factor(16) == 1.0
    calibration.observe(16, predicted=0.01, seconds=0.02)
    assert calibration.factor(16) == pytest.approx(2.0)
    assert calibration.factor(16, rows=16) == pytest.approx(1.2)
    calibration.observe(4, predicted=0.01, seconds=0.02, rows=0)  # nothing to learn
    assert not any(isinstance(size, tuple) and size[0] == 0 for size in calibration.ratios)


def test_a_round_is_priced_with_its_rows_cell() -> None:
    """RoundPrices asks the calibration for its own row count's cells: a drafted round of
    4 rows is priced with the 4-row drafted correction, a plain one with the plain."""
    costs = VerifyCurveCostModel(lambda tokens: 1.0 + 0.1 * tokens)
    calibration = BatchPassCalibration()
    calibration.observe(4, predicted=1.0, seconds=1.5, rows=4)
    calibration.observe(10, predicted=1.0, seconds=0.5, rows=4)
    calibration.observe(10, predicted=1.0, seconds=3.0, rows=8)
    prices = RoundPrices(costs, 4, 0, calibration, BatchPassCalibration(), None)
    assert prices.round(4, 1, 0) == pytest.approx(1.5 * costs.verify_cost(4, 0))
    assert prices.round(10, 4, 0) == pytest.approx(0.5 * costs.verify_cost(10, 0))


def test_draft_realism_is_realized_over_expected_within_its_window_and_bounds() -> None:
    realism = DraftRealism(window=4, min_expected=3.0, low=0.25, high=1.5)
    assert realism.factor() == 1.0
    realism.observe(2.0, 1)
    assert realism.factor() == 1.0  # 2 tokens expected: too few to judge
    realism.observe(2.0, 1)
    assert realism.factor() == pytest.approx(0.5)
    for _ in range(4):  # the window keeps the last four rows only
        realism.observe(1.0, 0)
    assert realism.factor() == pytest.approx(0.25)  # 0 / 4, held at the floor
    for _ in range(4):
        realism.observe(1.0, 3)
    assert realism.factor() == pytest.approx(1.5)  # 12 / 4, held at the ceiling
    for bad in ({"window": 0}, {"low": 0.0}, {"low": 1.5}, {"high": 0.5}, {"min_expected": -1}):
        with pytest.raises(ValueError):
            DraftRealism(**bad)  # type: ignore[arg-type]


@given(rounds=st.lists(st.tuples(st.floats(0.0, 8.0), st.integers(0, 8)), max_size=60))
def test_draft_realism_matches_a_recount_of_its_window(rounds: list[tuple[float, int]]) -> None:
    """The running sums equal a recount of the last ``window`` rows (the oracle)."""
    realism = DraftRealism(window=7, min_expected=1.0)
    for expected, realized in rounds:
        realism.observe(expected, realized)
    kept = rounds[-7:]
    total = sum(e for e, _ in kept)
    if total < 1.0:
        assert realism.factor() == 1.0
    else:
        expect = min(max(sum(r for _, r in kept) / total, realism.low), realism.high)
        assert realism.factor() == pytest.approx(expect, rel=1e-9, abs=1e-9)


def _proposal() -> Draft:
    return Draft((1, 2, 3, 4), LOOKUP, match_length=8)


def test_drafts_that_bring_nothing_stop_the_policy_drafting() -> None:
    """Each verified token costing a tenth of a step, a 2-row batch drafts; when every
    drafted row commits one token only, the realism falls and the same round runs plain.
    Rows that never drafted teach it nothing."""
    costs = VerifyCurveCostModel(lambda tokens: 1.0 + 0.1 * tokens)
    realism = DraftRealism(window=64, min_expected=4.0, low=0.05)
    policy = CostModelBatchPolicy(costs, max_draft_length=4, explore_plain=False, realism=realism)
    policy.reset(3)
    proposals = [_proposal(), _proposal()]
    first = policy.draft_lengths([0, 1], proposals, [100, 100])
    assert sum(first) > 0
    policy.observe(2, proposals[0], [5])  # a row not in the plan: nothing learned
    assert realism.factor() == 1.0
    for _ in range(20):
        lengths = policy.draft_lengths([0, 1], proposals, [100, 100])
        if not any(lengths):
            break
        for row, length in enumerate(lengths):
            # The acceptance estimates learn too; keep them optimistic (the first token
            # is accepted) so that only the realism can stop the drafting.
            policy.observe(row, proposals[row], [1] if length else [7])
    assert policy.draft_lengths([0, 1], proposals, [100, 100]) == [0, 0]
    assert realism.factor() < 0.2


def test_a_draft_never_observed_does_not_count_in_a_later_round() -> None:
    """A drafted row that leaves unobserved (its logits failed) is not paired with the
    tokens its lane commits in a later round it did not draft."""
    costs = VerifyCurveCostModel(lambda tokens: 1.0 + 0.1 * tokens)
    realism = DraftRealism(min_expected=0.0)
    policy = CostModelBatchPolicy(costs, max_draft_length=4, explore_plain=False, realism=realism)
    policy.reset(2)
    assert any(policy.draft_lengths([0, 1], [_proposal(), _proposal()], [100, 100]))
    # not observed; the next round has nothing to copy, so nobody drafts
    empty = Draft((), LOOKUP)
    assert policy.draft_lengths([0, 1], [empty, empty], [100, 100]) == [0, 0]
    policy.observe(0, empty, [9])
    policy.observe(1, empty, [9])
    assert realism.factor() == 1.0  # nothing was paired
