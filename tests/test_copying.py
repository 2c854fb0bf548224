"""Copy evidence (the knapsack planner's search gate) against a brute-force oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.planners.copying import CopyTracker, copied_fraction
from knapspec.testing import examples


def brute_force(tokens: list[int], ngram: int, recent: int) -> float:
    span = ngram + 1
    ends = list(range(span - 1, len(tokens)))  # indices of tokens that end a full gram
    scored = ends[1:][-recent:]  # the first gram has nothing before it
    if not scored:
        return 0.0
    hits = 0
    for end in scored:
        gram = tokens[end - span + 1 : end + 1]
        if any(tokens[e - span + 1 : e + 1] == gram for e in ends if e < end):
            hits += 1
    return hits / len(scored)


@settings(max_examples=examples(300), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    ngram=st.integers(1, 4),
    recent=st.integers(1, 20),
)
def test_copied_fraction_matches_brute_force(tokens: list[int], ngram: int, recent: int) -> None:
    got = copied_fraction(torch.tensor(tokens, dtype=torch.long), ngram=ngram, recent=recent)
    assert got == pytest.approx(brute_force(tokens, ngram, recent))


def test_copying_and_fresh_text() -> None:
    passage = list(range(100, 140))
    copied = torch.tensor([*passage, 7, 8, *passage[:20]])
    assert copied_fraction(copied, ngram=3, recent=16) == 1.0
    fresh = torch.arange(200)  # no gram ever repeats
    assert copied_fraction(fresh) == 0.0
    assert copied_fraction(torch.tensor([1, 2])) == 0.0  # too short to score


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ngram"):
        copied_fraction(torch.arange(5), ngram=0)
    with pytest.raises(ValueError, match="1-D"):
        copied_fraction(torch.zeros(2, 3, dtype=torch.long))


@settings(max_examples=examples(200), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    ngram=st.integers(1, 3),
    recent=st.integers(1, 10),
)
def test_the_incremental_tracker_equals_the_batch_function(
    tokens: list[int], cuts: list[int], ngram: int, recent: int
) -> None:
    """Fed growing prefixes (as the decoder does), the tracker returns the batch answer."""
    tracker = CopyTracker(ngram, recent)
    sequence = torch.tensor(tokens, dtype=torch.long)
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        prefix = sequence[:cut]
        expected = copied_fraction(prefix, ngram=ngram, recent=recent)
        assert tracker.update(prefix) == pytest.approx(expected)


def test_the_tracker_starts_over_on_another_sequence() -> None:
    tracker = CopyTracker(2, 4)
    copied = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    # grams ending at the last 4 tokens: (3,4,1) (4,1,2) new, (1,2,3) (2,3,4) repeated
    assert tracker.update(copied) == copied_fraction(copied, ngram=2, recent=4) == 0.5
    fresh = torch.tensor([9, 8, 7, 6, 5])
    assert tracker.update(fresh) == copied_fraction(fresh, ngram=2, recent=4) == 0.0
