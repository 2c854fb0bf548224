"""The replay of ``benchmarks/ngram_ceiling.py``: vLLM's n-gram rule (the earliest
occurrence of the longest suffix n-gram) against a brute-force search, and the round
bookkeeping against proposers whose outcome is known."""

from __future__ import annotations

import math

from benchmarks.ngram_ceiling import lookup_proposers, ngram_proposal, replay
from hypothesis import given
from hypothesis import strategies as st

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=25)


def _brute(context: list[int], k: int, low: int, high: int) -> list[int]:
    """Every (n, start) with the suffix n-gram at ``start``: the largest n, then the
    smallest start."""
    found = [
        (n, start)
        for n in range(low, high + 1)
        if n < len(context)
        for start in range(len(context) - n)
        if context[start : start + n] == context[-n:]
    ]
    if not found:
        return []
    n = max(n for n, _ in found)
    start = min(s for m, s in found if m == n)
    return context[start + n : start + n + k]


@given(context=tokens, k=st.integers(1, 6), low=st.integers(1, 2), extra=st.integers(0, 3))
def test_the_ngram_rule_is_the_earliest_occurrence_of_the_longest_suffix(
    context: list[int], k: int, low: int, extra: int
) -> None:
    assert ngram_proposal(context, k, low, low + extra) == _brute(context, k, low, low + extra)


@given(answer=st.lists(st.integers(0, 9), min_size=1, max_size=40), k=st.integers(0, 5))
def test_a_never_wrong_proposer_commits_k_plus_one_tokens_a_round(
    answer: list[int], k: int
) -> None:
    prompt = [42]

    def perfect(context: list[int]) -> list[int]:
        done = len(context) - len(prompt)
        return answer[done : done + k]

    rounds, drafted, accepted = replay(prompt, answer, perfect)
    assert drafted >= accepted
    assert rounds == math.ceil(len(answer) / (k + 1))
    assert accepted == len(answer) - rounds  # every round commits one token of its own


def test_history_drafts_an_earlier_answer_and_is_off_at_zero() -> None:
    prompt, answer = [1, 2, 3], [7, 8, 9, 10, 11, 12]
    for budget, expected_rounds in ((0, len(answer)), (100, 1)):
        start = lookup_proposers(cap=8, history_tokens=budget)
        propose, finish = start(prompt)
        replay(prompt, answer, propose)
        finish(prompt + answer)
        # the same request again: with history it copies the whole earlier answer
        propose, finish = start(prompt)
        rounds, _, _ = replay(prompt, answer, propose)
        assert rounds == expected_rounds
