"""The lookup drafter's history (issue #31, item 3): earlier calls' sequences vote on a
proposal. The index with history against a brute-force scan, the history's bound and
eviction, incremental indexing of a grown sequence, and a second call on the same prompt
drafting its whole answer from the first, losslessly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.tiny_models import greedy_reference, tiny_model

from knapspec.config import ConfigError, DecoderConfig
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters import DraftRequest, LookupConfig, LookupDrafter, LookupIndex

sequences = st.lists(st.integers(0, 3), min_size=1, max_size=30)


def _brute_match(source: list[int], end: int, context: list[int], cap: int) -> int:
    length = 0
    while (
        length < cap
        and length <= end
        and length < len(context)
        and source[end - length] == context[len(context) - 1 - length]
    ):
        length += 1
    return length


def _brute_propose(
    context: list[int],
    history: list[list[int]],
    max_ngram: int,
    max_tokens: int,
    max_candidates: int,
    max_match: int,
) -> tuple[list[int], list[float], int]:
    """Scan every source for the context's suffix; vote as the module docstring says."""
    sources = [*history, context]

    def ends(source: list[int], n: int) -> list[int]:
        suffix = context[-n:]
        return [
            e
            for e in range(n - 1, len(source) - 1)  # a continuation must follow e
            if source[e - n + 1 : e + 1] == suffix
        ]

    n = 0
    for length in range(min(max_ngram, len(context)), 0, -1):
        if any(ends(source, length) for source in sources):
            n = length
            break
    if n == 0:
        return [], [], 0
    occurrences = [(source, e) for source in sources for e in ends(source, n)]
    candidates = [
        (source, e + 1, _brute_match(source, e, context, max_match))
        for source, e in occurrences[-max_candidates:]
    ]
    proposal: list[int] = []
    support: list[float] = []
    active = list(range(len(candidates)))
    first: list[int] = []
    for step in range(max_tokens):
        votes: dict[int, float] = {}
        for i in active:
            source, start, weight = candidates[i]
            if start + step < len(source):
                token = source[start + step]
                votes[token] = votes.get(token, 0.0) + weight
        if not votes:
            break
        top = max(votes.values())
        # Ties: the token whose first vote came from the most recent occurrence.
        chosen = max(
            (t for t in votes if votes[t] == top),
            key=lambda t: _first_index(candidates, active, step, t),
        )
        proposal.append(chosen)
        support.append(votes[chosen] / sum(votes.values()))
        active = [i for i in active if _votes_for(candidates[i], step, chosen)]
        if step == 0:
            first = active
    match = max((candidates[i][2] for i in first), default=n)
    return proposal, support, match


def _votes_for(candidate: tuple[list[int], int, int], step: int, token: int) -> bool:
    source, start, _ = candidate
    return start + step < len(source) and source[start + step] == token


def _first_index(
    candidates: list[tuple[list[int], int, int]], active: list[int], step: int, token: int
) -> int:
    """The oldest active candidate voting for ``token`` (when its first vote came)."""
    return min(i for i in active if _votes_for(candidates[i], step, token))


@given(
    context=sequences,
    history=st.lists(sequences, max_size=3),
    max_ngram=st.integers(1, 4),
    max_tokens=st.integers(1, 6),
    max_candidates=st.integers(1, 5),
    max_match=st.integers(4, 8),
)
def test_a_proposal_with_history_equals_a_brute_force_scan(
    context: list[int],
    history: list[list[int]],
    max_ngram: int,
    max_tokens: int,
    max_candidates: int,
    max_match: int,
) -> None:
    indexes = []
    for sequence in history:
        index = LookupIndex(max_ngram)
        index.extend(sequence)
        indexes.append(index)
    current = LookupIndex(max_ngram)
    current.extend(context)
    got = current.propose(
        max_tokens, max_candidates=max_candidates, max_match=max_match, history=indexes
    )
    want = _brute_propose(context, history, max_ngram, max_tokens, max_candidates, max_match)
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == pytest.approx(want[1])


@given(calls=st.lists(sequences, min_size=1, max_size=8), budget=st.integers(0, 40))
def test_the_history_keeps_the_latest_sequences_within_its_budget(
    calls: list[list[int]], budget: int
) -> None:
    drafter = LookupDrafter(LookupConfig(history_tokens=budget))
    archived: list[list[int]] = []
    for tokens in calls:
        previous = list(drafter.index.tokens)
        drafter.reset(tokens)
        grown = previous and tokens[: len(previous)] == previous
        if previous and not grown:
            archived.append(previous)
        assert drafter.index.tokens == tokens
        assert drafter.history_size <= budget
        kept = [index.tokens for index in drafter.history]
        # what is kept is the most recent archived sequences that fit, in order
        fitting = [s for s in archived if 2 <= len(s) <= budget]
        assert kept == fitting[len(fitting) - len(kept) :]
        if fitting and len(fitting[-1]) <= budget:
            assert kept and kept[-1] == fitting[-1]


@given(first=sequences, more=sequences, max_tokens=st.integers(1, 6))
def test_a_grown_sequence_is_indexed_as_if_from_scratch(
    first: list[int], more: list[int], max_tokens: int
) -> None:
    grown = LookupDrafter(LookupConfig(max_tokens=max_tokens, history_tokens=0))
    grown.reset(first)
    grown.reset(first + more)  # a conversation's next turn: extended, not archived
    fresh = LookupDrafter(LookupConfig(max_tokens=max_tokens, history_tokens=0))
    fresh.reset(first + more)
    assert len(grown.history) == 0
    assert grown.propose(DraftRequest(10)).tokens == fresh.propose(DraftRequest(10)).tokens


def test_history_off_forgets_the_last_call() -> None:
    drafter = LookupDrafter(LookupConfig(history_tokens=0))
    drafter.reset([5, 6, 7, 8, 9])
    drafter.reset([1, 5, 6])
    assert drafter.propose(DraftRequest(4)).tokens == ()
    on = LookupDrafter(LookupConfig(history_tokens=100))
    on.reset([5, 6, 7, 8, 9])
    on.reset([1, 5, 6])
    assert on.propose(DraftRequest(4)).tokens == (7, 8, 9)
    on.clear_history()
    assert on.propose(DraftRequest(4)).tokens == ()


def test_the_rows_of_a_batch_keep_one_history_within_one_budget() -> None:
    """A server's lanes: what one row finished drafts for another row's later request,
    and the rows' archived sequences share ``history_tokens``."""
    config = LookupConfig(history_tokens=12)
    rows = [LookupDrafter(config) for _ in range(3)]
    for row in rows:
        row.share_rows(rows)
    rows[0].reset([5, 6, 7, 8, 9])
    rows[0].reset([40, 41])  # row 0's first request is archived
    rows[2].reset([1, 5, 6])
    assert rows[2].propose(DraftRequest(4)).tokens == (7, 8, 9)
    rows[1].reset([20, 21, 22, 23, 24, 25, 26])
    rows[1].reset([30])  # 5 + 7 tokens: exactly the budget
    assert [index.tokens for index in rows[2].history] == [[5, 6, 7, 8, 9], [20, *range(21, 27)]]
    rows[2].reset([50, 51])  # 3 more: the oldest goes
    assert all(row.history_size <= 12 for row in rows)
    assert [index.tokens[0] for index in rows[0].history] == [20, 1]


def test_history_is_off_by_default() -> None:
    drafter = LookupDrafter()
    drafter.reset([5, 6, 7, 8, 9])
    drafter.reset([1, 5, 6])
    assert len(drafter.history) == 0 and drafter.propose(DraftRequest(4)).tokens == ()


def test_history_tokens_is_validated_by_the_config() -> None:
    with pytest.raises(ConfigError, match="history_tokens"):
        DecoderConfig.from_dict({"drafters": {"lookup": {"history_tokens": -1}}})


PROMPT = torch.tensor([3, 17, 9, 40, 2, 11, 8, 25, 4, 31, 6, 19])


def test_a_second_call_on_the_same_prompt_drafts_the_first_answer_losslessly() -> None:
    model = tiny_model("llama", 3)
    config = {
        "planner": {"name": "lookup", "draft_length": 8},
        "drafters": {"lookup": {"history_tokens": 4096}},
    }
    decoder = SpeculativeDecoder(model, config)
    reference = greedy_reference(model, PROMPT, 40)
    first = decoder.generate(PROMPT, max_new_tokens=40)
    second = decoder.generate(PROMPT, max_new_tokens=40)
    assert torch.equal(first.tokens, reference) and torch.equal(second.tokens, reference)
    # The second call's drafts come from the first call's answer: nearly every one lands.
    assert second.stats.accepted_tokens >= 30
    assert second.stats.accepted_tokens > first.stats.accepted_tokens
    assert second.stats.rounds < first.stats.rounds
    # Forgotten (what the benchmarks do before each timed call): drafted as the first call.
    decoder.clear_history()
    third = decoder.generate(PROMPT, max_new_tokens=40)
    assert torch.equal(third.tokens, reference)
    assert third.stats.accepted_tokens == first.stats.accepted_tokens
    assert third.stats.rounds == first.stats.rounds


def test_a_batch_row_drafts_from_another_rows_output_losslessly() -> None:
    """Row 1's prompt is row 0's prompt plus the first 10 tokens of its answer, so row 1
    writes ahead what row 0 writes next: with history on, row 0 drafts it from row 1."""
    from knapspec.planners.batch.policy import FixedLookupBatchPolicy

    model = tiny_model("llama", 3)
    reference = greedy_reference(model, PROMPT, 40)
    ahead = torch.cat([PROMPT, reference[:10]])
    accepted = {}
    for history in (0, 4096):
        config = {
            "planner": {"name": "lookup", "draft_length": 8},
            "drafters": {"lookup": {"history_tokens": history}},
        }
        decoder = SpeculativeDecoder(model, config)
        result = decoder.generate_batch(
            [PROMPT, ahead], max_new_tokens=30, policy=FixedLookupBatchPolicy(8)
        )
        assert torch.equal(result.tokens[0], reference[:30])
        assert torch.equal(result.tokens[1], greedy_reference(model, ahead, 30))
        accepted[history] = result.stats[0].accepted_tokens
    assert accepted[4096] > accepted[0]


def test_the_index_leaves_the_garbage_collector_a_few_objects_not_one_per_gram() -> None:
    """A list per gram made a full collection walk every one of them (0.8 s pauses at 30k
    tokens); the chains are flat lists, and int-only tuple keys are untracked."""
    import gc
    import random

    rng = random.Random(0)
    gc.collect()
    before = len(gc.get_objects())
    index = LookupIndex(4)
    index.extend([rng.randrange(1000) for _ in range(20_000)])
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert len(index.occurrences(tuple(index.tokens[100:101]))) >= 1
