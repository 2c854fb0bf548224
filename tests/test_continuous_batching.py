"""Continuous batching (``generate_batch(..., max_batch_rows=S)``): with fewer slots than
prompts, every row still equals its prompt decoded alone and caches exactly its accepted
tokens, at most ``S`` rows run at once, a finished row's slot goes to a waiting prompt
while the others keep running, sampled rows stay distributed as the target, and bad
``max_batch_rows`` values are clear errors that leave the decoder usable."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.test_batch import (
    PROMPTS,
    REPEATING,
    _assert_rows_equal_alone,
    _check_cache,
    _decoder,
    prompt_lists,
)
from tests.test_sampling import _chi_square_pvalue, _exact_joint, _small_vocab_model
from tests.tiny_models import greedy_reference, tiny_model

from knapspec.decoding.continuous import ContinuousBatch
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.planners import LookupPlanner
from knapspec.planners.batch.policy import FixedLookupBatchPolicy, PlainBatchPolicy
from knapspec.sampling import SamplingParams


@given(
    prompts=prompt_lists.filter(lambda p: len(p) >= 2),
    slots=st.integers(1, 3),
    new=st.integers(1, 10),
    draft=st.integers(0, 4),
)
def test_each_row_equals_its_prompt_alone_whatever_the_slots(
    prompts: list[list[int]], slots: int, new: int, draft: int
) -> None:
    policy = FixedLookupBatchPolicy(draft) if draft else PlainBatchPolicy()
    result = _decoder().generate_batch(
        prompts, max_new_tokens=new, policy=policy, max_batch_rows=slots
    )
    _assert_rows_equal_alone("llama", prompts, result, new)
    assert [s.new_tokens for s in result.stats] == [new] * len(prompts)


def test_a_finished_row_hands_its_slot_to_a_waiting_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Row 1 stops early on EOS; row 2 must then run beside row 0 (a refill, not a second
    batch after the first), no round may run more than 2 rows, and every row's cache holds
    exactly its committed tokens after every round."""
    actives: list[list[int]] = []
    original = ContinuousBatch._round

    def checked_round(self):  # type: ignore[no-untyped-def]
        active, cache = self._active, self._cache
        actives.append(list(active))
        assert cache.rows == len(active) <= 2
        original(self)
        _check_cache(self, cache, active)

    monkeypatch.setattr(ContinuousBatch, "_round", checked_round)
    model = tiny_model("llama", 3)
    prompts = [REPEATING[:12], [40, 41, 42, 43], [7, 8], REPEATING[3:10]]
    stop = int(greedy_reference(model, torch.tensor(prompts[1]), 3)[2])
    result = _decoder().generate_batch(
        prompts,
        max_new_tokens=14,
        eos_token_id=stop,
        policy=FixedLookupBatchPolicy(3),
        max_batch_rows=2,
    )
    assert result.stop_reasons[1] == "eos" and result.tokens[1][-1] == stop
    for row in (0, 2, 3):
        expected = greedy_reference(model, torch.tensor(prompts[row]), 14)
        cut = next((i + 1 for i, t in enumerate(expected.tolist()) if t == stop), 14)
        assert torch.equal(result.tokens[row], expected[:cut]), f"row {row}"
    assert actives[0] == [0, 1]
    assert any(0 in active and 2 in active for active in actives), actives
    assert {row for active in actives for row in active} == {0, 1, 2, 3}
    assert sum(stats.drafted_tokens for stats in result.stats) > 0


def test_rows_that_stop_on_their_first_token_never_block_the_queue() -> None:
    prompts = [[1, 2, 3], [4, 5], [6], REPEATING[:9]]
    result = _decoder().generate_batch(prompts, max_new_tokens=1, max_batch_rows=1)
    _assert_rows_equal_alone("llama", prompts, result, 1)
    assert result.stop_reasons == ["max_new_tokens"] * 4
    assert all(stats.rounds == 0 for stats in result.stats)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "max_batch_rows must be >= 1, got 0"),
        (-2, ValueError, "max_batch_rows must be >= 1"),
        (True, TypeError, "max_batch_rows must be an integer or None, got bool"),
        ("2", TypeError, "max_batch_rows must be an integer or None, got str"),
        (1.5, TypeError, "got float"),
    ],
)
def test_bad_max_batch_rows_are_clear_errors(
    value: object, error: type[Exception], message: str
) -> None:
    decoder = _decoder()
    with pytest.raises(error, match=message):
        decoder.generate_batch([[1, 2], [3, 4]], max_batch_rows=value)  # type: ignore[arg-type]
    prompts = [[1, 2, 3], REPEATING[:12], [9]]
    result = decoder.generate_batch(prompts, max_new_tokens=5, max_batch_rows=2)
    _assert_rows_equal_alone("llama", prompts, result, 5)


def test_more_slots_than_prompts_is_one_batch() -> None:
    prompts = [[1, 2, 3], REPEATING[:12]]
    result = _decoder().generate_batch(prompts, max_new_tokens=6, max_batch_rows=8)
    _assert_rows_equal_alone("llama", prompts, result, 6)


RUNS = 1200


def test_sampled_rows_through_one_slot_are_distributed_as_the_target() -> None:
    """One slot: each row runs after the other finished, drafting 3-token lookups."""
    decoder = SpeculativeDecoder(_small_vocab_model(), planner=LookupPlanner())
    params = SamplingParams(do_sample=True, temperature=1.0)
    counts: list[Counter[tuple[int, ...]]] = [Counter() for _ in PROMPTS]
    drafted = 0
    for run in range(RUNS):
        result = decoder.generate_batch(
            PROMPTS,
            max_new_tokens=4,
            sampling=params,
            seeds=[2 * run, 2 * run + 1],
            policy=FixedLookupBatchPolicy(3),
            max_batch_rows=1,
        )
        for row, tokens in enumerate(result.tokens):
            counts[row][tuple(tokens.tolist())] += 1
        drafted += sum(stats.drafted_tokens for stats in result.stats)
    assert drafted > RUNS  # lookup drafts were verified
    model = _small_vocab_model()
    for row, prompt in enumerate(PROMPTS):
        joint = _exact_joint(model, prompt, params, 4)
        assert _chi_square_pvalue(counts[row], joint) > 1e-3, f"row {row}"
