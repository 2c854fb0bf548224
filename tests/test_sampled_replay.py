"""``benchmarks/sampled_replay.py``: the wall-time ceiling a decode-phase speed puts on a
call whose prefill no drafter shortens."""

from __future__ import annotations

import pytest
from benchmarks.sampled_replay import wall_bound
from hypothesis import given
from hypothesis import strategies as st

seconds = st.floats(0.01, 100.0)
speeds = st.floats(0.1, 50.0)


@given(seconds, seconds, speeds, speeds)
def test_the_bound_rises_with_decode_speed_and_stays_under_the_prefill_ceiling(
    prefill: float, decode: float, slow: float, fast: float
) -> None:
    slow, fast = sorted((slow, fast))
    assert wall_bound(prefill, decode, slow) <= wall_bound(prefill, decode, fast) + 1e-12
    # However fast the decode phase, the call still pays its prefill.
    ceiling = (prefill + decode) / prefill
    assert wall_bound(prefill, decode, fast) < ceiling
    assert wall_bound(prefill, decode, 1.0) == pytest.approx(1.0)


def test_with_a_third_of_the_call_in_prefill_1_25x_wall_needs_about_1_43x_decode() -> None:
    # Issue #31's sampling goal at 2,048 tokens: P = 5 s, D = 10 s of plain sampling.
    assert wall_bound(5.0, 10.0, 1.4) == pytest.approx(15.0 / (5.0 + 10.0 / 1.4))
    assert wall_bound(5.0, 10.0, 1.4) < 1.25 < wall_bound(5.0, 10.0, 1.5)


def test_the_bound_rejects_impossible_timings() -> None:
    with pytest.raises(ValueError, match="decode > 0"):
        wall_bound(1.0, 0.0, 1.2)
    with pytest.raises(ValueError, match="speed-up > 0"):
        wall_bound(1.0, 2.0, 0.0)
