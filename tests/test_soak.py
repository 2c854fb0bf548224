"""benchmarks/soak.py's memory verdict (the hour-long run itself is not a test)."""

from __future__ import annotations

from benchmarks.soak import rss_flat

MB = 2**20


def test_flat_memory_passes_and_growth_fails() -> None:
    warm = [100 * MB, 120 * MB, 121 * MB]
    assert rss_flat([*warm, *[122 * MB] * 9], warmup=3)  # +0.8 %
    assert not rss_flat([*warm, *[121 * MB] * 6, 130 * MB, 131 * MB, 132 * MB], warmup=3)
    # a spike in the middle that the run gives back is no leak
    assert rss_flat([*warm, 140 * MB, *[121 * MB] * 8], warmup=3)


def test_a_run_too_short_to_judge_passes() -> None:
    assert rss_flat([100 * MB], warmup=1)
    assert rss_flat([100 * MB, 200 * MB], warmup=0)
