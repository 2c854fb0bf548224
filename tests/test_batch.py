"""Batched generation: each row equals its prompt decoded alone, ragged acceptance keeps
exactly each row's accepted tokens, finished rows leave the batch, errors name the row,
sampled rows are distributed as the target, and the batch-level policy stops drafting
when a wide verification costs more than it gains."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.test_sampling import (
    _chi_square_pvalue,
    _exact_joint,
    _small_vocab_model,
)
from tests.tiny_models import greedy_reference, tiny_model

import knapspec.decoding.batch_round as round_module
import knapspec.decoding.sampler as sampler_module
from knapspec.decoding.batch import BatchGenerationResult
from knapspec.decoding.continuous import ContinuousBatch
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.decoding.run import GenerationResult
from knapspec.decoding.verify import Verdict
from knapspec.drafters.base import LOOKUP, Draft
from knapspec.model.batch_cache import BatchKVCache
from knapspec.model.engine import ContextLengthError
from knapspec.model.passes.batched import AttentionLayout, splits_attention
from knapspec.planners import LookupPlanner
from knapspec.planners.batch.policy import (
    BatchPassCalibration,
    CostModelBatchPolicy,
    FixedLookupBatchPolicy,
    PlainBatchPolicy,
    batched_verify_cost,
    packed_verify_cost,
)
from knapspec.planners.batch.pricing import PLAIN_SAMPLES, RoundPrices, row_attention_cost
from knapspec.sampling import SamplingParams
from knapspec.testing import VerifyCurveCostModel

REPEATING = [5, 17, 23, 42, 8, 61, 3, 9, 30, 11] * 3


def _decoder(family: str = "llama") -> SpeculativeDecoder:
    # The lookup planner builds no cost model: nothing is profiled.
    return SpeculativeDecoder(tiny_model(family, 3), planner=LookupPlanner())


def _assert_rows_equal_alone(
    family: str, prompts: Sequence[Sequence[int]], result: BatchGenerationResult, new: int
) -> None:
    model = tiny_model(family, 3)
    for row, prompt in enumerate(prompts):
        expected = greedy_reference(model, torch.tensor(prompt), new)
        assert torch.equal(result.tokens[row], expected), f"row {row} differs"
        assert torch.equal(result.sequences[row][0], torch.cat([torch.tensor(prompt), expected]))


prompt_lists = st.lists(
    st.one_of(
        st.lists(st.integers(0, 96), min_size=1, max_size=14),
        # Repeating text, so lookup proposals exist and get accepted.
        st.integers(0, 20).map(lambda cut: REPEATING[cut : cut + 14]),
    ),
    min_size=1,
    max_size=4,
)


@given(prompts=prompt_lists, new=st.integers(1, 12), draft=st.integers(0, 4))
def test_each_greedy_row_equals_its_prompt_decoded_alone(
    prompts: list[list[int]], new: int, draft: int
) -> None:
    decoder = _decoder()
    policy = FixedLookupBatchPolicy(draft) if draft else PlainBatchPolicy()
    result = decoder.generate_batch(prompts, max_new_tokens=new, policy=policy)
    _assert_rows_equal_alone("llama", prompts, result, new)
    assert result.stop_reasons == ["max_new_tokens"] * len(prompts)
    assert [s.new_tokens for s in result.stats] == [new] * len(prompts)


@pytest.mark.parametrize("family", ["qwen3"])
def test_rows_equal_alone_on_qwen3_with_left_padding(family: str) -> None:
    prompts = [REPEATING[:20], [3, 1, 4], REPEATING[4:13]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    decoder = _decoder(family)
    result = decoder.generate(ids, attention_mask=mask, max_new_tokens=10)
    _assert_rows_equal_alone(family, prompts, result, 10)
    result = decoder.generate_batch(ids, mask, max_new_tokens=10, policy=FixedLookupBatchPolicy(3))
    _assert_rows_equal_alone(family, prompts, result, 10)
    assert result.stats[0].drafted_tokens > 0


def test_a_single_prompt_keeps_the_single_sequence_path() -> None:
    decoder = _decoder()
    assert isinstance(decoder.generate(torch.tensor([1, 2, 3]), max_new_tokens=3), GenerationResult)
    assert isinstance(decoder.generate([1, 2, 3], max_new_tokens=3), GenerationResult)
    assert isinstance(decoder.generate([[1, 2, 3]], max_new_tokens=3), BatchGenerationResult)


def _check_cache(run: ContinuousBatch, cache: BatchKVCache, active: list[int]) -> None:
    """Every active row caches exactly its committed tokens but the pending one, and their
    K/V equal a single-sequence prefill of that row's committed sequence."""
    engine = run.engine
    for slot, index in enumerate(active):
        row = run.rows[index]
        committed = torch.cat([row.request.prompt, torch.tensor(row.output[:-1])])
        assert cache.lengths[slot] == committed.numel()
        single = engine.new_cache(64)
        engine.forward(committed, 0, single, all_logits=False)
        for layer in range(engine.num_layers):
            keys = cache.keys(layer, committed.numel())[slot]
            torch.testing.assert_close(keys, single.keys(layer), atol=1e-5, rtol=1e-4)
            values = cache.values(layer, committed.numel())[slot]
            torch.testing.assert_close(values, single.values(layer), atol=1e-5, rtol=1e-4)


def checked_rounds(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Check every row's cache after every batched round (:func:`_check_cache`); the
    returned list fills with each round's ``(drafted, accepted)`` per active row."""
    rounds: list[list[tuple[int, int]]] = []
    original = ContinuousBatch._round

    def checked_round(self):  # type: ignore[no-untyped-def]
        active, cache = self._active, self._cache
        stats = [self.rows[r].stats for r in active]
        before = [(s.drafted_tokens, s.accepted_tokens) for s in stats]
        original(self)
        after = [(s.drafted_tokens, s.accepted_tokens) for s in stats]
        rounds.append(
            [(d1 - d0, a1 - a0) for (d0, a0), (d1, a1) in zip(before, after, strict=True)]
        )
        _check_cache(self, cache, active)

    monkeypatch.setattr(ContinuousBatch, "_round", checked_round)
    return rounds


def test_each_row_caches_exactly_its_accepted_tokens_with_ragged_acceptance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds = checked_rounds(monkeypatch)
    # Row 0 repeats (its drafts are accepted), row 1 repeats a pattern the model does not
    # continue (its drafts are rejected).
    prompts = [REPEATING, [4, 4, 4, 4, 4, 4, 4, 4], [60, 2, 7]]
    result = _decoder().generate_batch(prompts, max_new_tokens=16, policy=FixedLookupBatchPolicy(4))
    _assert_rows_equal_alone("llama", prompts, result, 16)
    ragged = [
        r
        for r in rounds
        if any(d > 0 and a == d for d, a in r) and any(d > 0 and a == 0 for d, a in r)
    ]
    assert ragged, f"no round had a row accepting all and a row accepting none: {rounds}"


def test_finished_rows_leave_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[int] = []
    original = round_module.forward_batch

    def counting(engine, token_ids, starts, cache, **kwargs):  # type: ignore[no-untyped-def]
        widths.append(token_ids.shape[0])
        return original(engine, token_ids, starts, cache, **kwargs)

    monkeypatch.setattr(round_module, "forward_batch", counting)
    model = tiny_model("llama", 3)
    prompts = [[1, 2, 3], [40, 41, 42, 43], [7, 8]]
    stop = int(greedy_reference(model, torch.tensor(prompts[1]), 3)[2])
    result = _decoder().generate(prompts, max_new_tokens=12, eos_token_id=stop)
    assert result.stop_reasons[1] == "eos" and result.tokens[1][-1] == stop
    for row in (0, 2):
        expected = greedy_reference(model, torch.tensor(prompts[row]), 12)
        cut = next((i + 1 for i, t in enumerate(expected.tolist()) if t == stop), 12)
        assert torch.equal(result.tokens[row], expected[:cut])
    assert widths[0] == 3 and min(widths) < 3  # rows stopped and left the compute


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda d: d.generate(
                torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3)
            ),
            ValueError,
            "attention_mask has shape",
        ),
        (
            lambda d: d.generate(
                torch.ones(2, 3, dtype=torch.long),
                attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
            ),
            ValueError,
            "row 1: attention_mask must be left padding",
        ),
        (
            lambda d: d.generate(
                torch.ones(2, 3, dtype=torch.long),
                attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
            ),
            ValueError,
            "row 1: the prompt is empty",
        ),
        (lambda d: d.generate([[1, 2], []]), ValueError, "row 1: the prompt is empty"),
        (lambda d: d.generate([[1, 2], [3, 500]]), ValueError, r"row 1: token ids must be in"),
        (
            lambda d: d.generate([[1, 2], [3] * 250, [4]], max_new_tokens=10),
            ContextLengthError,
            "row 1: 250 prompt tokens",
        ),
        (lambda d: d.generate([[1, 2]], max_new_tokens=0), ValueError, "max_new_tokens"),
        (
            lambda d: d.generate_batch([[1], [2]], seeds=[1]),
            ValueError,
            "seeds has 1 entries for a batch of 2",
        ),
        (
            lambda d: d.generate([[1], [2]], streamer=object()),
            ValueError,
            "not supported for a batch",
        ),
        (lambda d: d.generate(torch.zeros(2, 5, dtype=torch.long)), ValueError, "attention_mask"),
    ],
)
def test_bad_batches_name_the_row_and_the_decoder_still_works(
    call,  # type: ignore[no-untyped-def]
    error: type[Exception],
    message: str,
) -> None:
    decoder = _decoder()
    with pytest.raises(error, match=message):
        call(decoder)
    prompts = [[1, 2, 3], REPEATING[:12]]
    result = decoder.generate(prompts, max_new_tokens=6)
    _assert_rows_equal_alone("llama", prompts, result, 6)


# ------------------------------------------------------------------ sampling per row
PROMPTS = [[1, 4, 2, 0, 3], [2, 2, 5, 1, 2, 2, 5, 1, 2, 2]]
LENGTH = 4
RUNS = 1500


def _batch_samples(params: SamplingParams, runs: int) -> tuple[list[Counter[tuple[int, ...]]], int]:
    decoder = SpeculativeDecoder(_small_vocab_model(), planner=LookupPlanner())
    counts: list[Counter[tuple[int, ...]]] = [Counter() for _ in PROMPTS]
    drafted = 0
    for run in range(runs):
        result = decoder.generate_batch(
            PROMPTS,
            max_new_tokens=LENGTH,
            sampling=params,
            seeds=[2 * run, 2 * run + 1],
            policy=FixedLookupBatchPolicy(3),
        )
        for row, tokens in enumerate(result.tokens):
            counts[row][tuple(tokens.tolist())] += 1
        drafted += sum(stats.drafted_tokens for stats in result.stats)
    return counts, drafted


@pytest.mark.parametrize(
    "scheme", ["position-keyed", pytest.param("rejection", marks=pytest.mark.slow)]
)
def test_sampled_rows_are_distributed_as_the_target(scheme: str) -> None:
    params = SamplingParams(do_sample=True, temperature=1.0, verification=scheme)
    counts, drafted = _batch_samples(params, RUNS)
    assert drafted > RUNS  # lookup drafts were verified
    model = _small_vocab_model()
    for row, prompt in enumerate(PROMPTS):
        joint = _exact_joint(model, prompt, params, LENGTH)
        assert _chi_square_pvalue(counts[row], joint) > 1e-3, f"row {row}"


def test_the_batch_chi_square_check_has_power_against_a_lossy_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepting every lookup draft token must be caught by the same test (rejection
    sampling's verifier; the position-keyed one's is checked with sub-network drafts)."""

    accepted: list[int] = []

    def accept_everything(drafts, draft_probs, target_probs, generator):  # type: ignore[no-untyped-def]
        accepted.append(len(drafts))
        bonus = int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))
        return Verdict(len(drafts), [*drafts, bonus])

    monkeypatch.setattr(sampler_module, "verify_sampling", accept_everything)
    params = SamplingParams(do_sample=True, temperature=1.0, verification="rejection")
    counts, _ = _batch_samples(params, RUNS)
    assert sum(accepted) > RUNS, "the lossy verifier never judged a draft"
    joint = _exact_joint(_small_vocab_model(), PROMPTS[1], params, LENGTH)
    assert _chi_square_pvalue(counts[1], joint) < 1e-6


def test_seeded_rows_are_reproducible() -> None:
    decoder = _decoder()
    params = SamplingParams(do_sample=True, temperature=1.0, seed=7)
    first = decoder.generate([[1, 2, 3], [1, 2, 3]], max_new_tokens=12, sampling=params)
    again = decoder.generate([[1, 2, 3], [1, 2, 3]], max_new_tokens=12, sampling=params)
    assert all(torch.equal(a, b) for a, b in zip(first.tokens, again.tokens, strict=True))
    # Rows get their own seeds: the same prompt in two rows samples differently.
    assert not torch.equal(first.tokens[0], first.tokens[1])


# ------------------------------------------------------------------ the batch policy
def _width_costs(flat: int) -> VerifyCurveCostModel:
    """Verification is memory-bound up to ``flat`` tokens, then costs per token."""
    return VerifyCurveCostModel(lambda tokens: max(1.0, tokens / flat))


def _proposal() -> Draft:
    return Draft((1, 2, 3, 4), LOOKUP, match_length=8)


def test_the_cost_model_policy_drafts_a_small_batch_and_not_a_large_one() -> None:
    policy = CostModelBatchPolicy(_width_costs(flat=4), max_draft_length=4, explore_plain=False)
    policy.reset(8)
    assert policy.draft_lengths([0], [_proposal()], [100]) == [3]  # 4 tokens cost one step
    eight = list(range(8))
    assert policy.draft_lengths(eight, [_proposal()] * 8, [100] * 8) == [0] * 8
    # Rows without a proposal draft nothing; the others still do in a small batch, and
    # since the products are packed, the idle row's one token leaves room for row 0 to
    # draft 2 (3 + 1 tokens cost one step; padded, 3 + 3 would not).
    assert policy.draft_lengths([0, 1], [_proposal(), Draft((), LOOKUP)], [50, 60]) == [2, 0]


def test_pass_calibration_takes_each_size_s_median_and_borrows_the_nearest() -> None:
    calibration = BatchPassCalibration(window=3)
    assert calibration.factor(8) == 1.0  # nothing seen: the cost model as it is
    calibration.observe(8, predicted=0.2, seconds=0.2)
    calibration.observe(40, predicted=0.4, seconds=0.8)
    calibration.observe(40, predicted=0.4, seconds=0.4)
    assert calibration.factor(8) == pytest.approx(1.0)
    assert calibration.factor(40) == pytest.approx(1.5)  # the median of 2.0 and 1.0
    assert calibration.factor(32) == pytest.approx(1.5)  # nearest seen size: 40
    assert calibration.factor(12) == pytest.approx(1.0)  # nearest seen size: 8
    calibration.observe(40, predicted=0.4, seconds=0.36)
    assert calibration.factor(40) == pytest.approx(1.0)  # median of 2.0, 1.0, 0.9
    calibration.observe(40, predicted=0.4, seconds=0.36)
    assert calibration.factor(40) == pytest.approx(0.9)  # the window dropped the 2.0
    calibration.observe(16, predicted=0.0, seconds=0.3)  # nothing to learn from
    assert 16 not in calibration.ratios
    with pytest.raises(ValueError, match="window"):
        BatchPassCalibration(window=0)


@given(
    first=st.floats(2.0, 20.0),
    later=st.lists(st.floats(0.8, 1.2), min_size=2, max_size=30),
)
def test_one_slow_first_pass_does_not_price_a_size_for_good(
    first: float, later: list[float]
) -> None:
    """The first pass at a new row count may run many times slower (buffers of a new
    size); two ordinary passes later the correction is an ordinary one again, and it
    stays within the ordinary ones' range (an average seeded by the first pass stayed
    above 2 for good)."""
    calibration = BatchPassCalibration()
    calibration.observe(16, predicted=0.03, seconds=0.03 * first)
    for ratio in later:
        calibration.observe(16, predicted=0.03, seconds=0.03 * ratio)
    assert min(later) - 1e-9 <= calibration.factor(16) <= max(later) + 1e-9


def test_a_wide_pass_that_ran_dear_stops_the_batch_drafting() -> None:
    """The cost model makes 4 rows × 4 tokens look as cheap as a plain step; once such a
    pass is measured at 4x its price, the policy prices it so and drafts nothing."""
    costs = _width_costs(flat=16)
    policy = CostModelBatchPolicy(costs, max_draft_length=3, explore_plain=False)
    policy.reset(4)
    rows = list(range(4))
    assert policy.draft_lengths(rows, [_proposal()] * 4, [100] * 4) == [3] * 4
    plain_price = batched_verify_cost(costs, 4, 1, 100)
    policy.observe_pass(4, 1, 100, plain_price)  # a plain pass costs what was predicted
    for extra in range(1, 13):  # every pass with drafts (5..16 real tokens) costs 4x
        widths = [1 + extra, 1, 1, 1]
        seconds = 4 * packed_verify_cost(costs, widths, 100)
        policy.observe_pass(4, max(widths), 100, seconds, widths=widths)
    assert policy.draft_lengths(rows, [_proposal()] * 4, [100] * 4) == [0] * 4
    # The decoder keeps the calibration across calls, for the same cost model only.
    decoder = SpeculativeDecoder(tiny_model("llama", 3), cost_model=costs)
    decoder.generate([REPEATING, REPEATING[3:]], max_new_tokens=6)
    learned = decoder._batch_calibration
    assert learned.ratios  # the passes were measured
    decoder.generate([REPEATING, REPEATING[3:]], max_new_tokens=6)
    assert decoder._batch_calibration is learned
    decoder.cost_model = _width_costs(flat=4)
    decoder.generate([REPEATING, REPEATING[3:]], max_new_tokens=6)
    assert decoder._batch_calibration is not learned


def test_plain_passes_run_before_drafting_at_a_row_count_until_their_price_is_known() -> None:
    """With fewer than PLAIN_SAMPLES plain passes of 4 rows measured, the round the search
    would draft runs plain; measured, the policy drafts where the measurement leaves
    drafting ahead, and plain passes measured far cheaper than their borrowed price keep
    it plain."""
    costs = _width_costs(flat=16)
    policy = CostModelBatchPolicy(costs, max_draft_length=3)
    policy.reset(4)
    rows, proposals = list(range(4)), [_proposal()] * 4
    for _ in range(PLAIN_SAMPLES):  # plain until its price rests on PLAIN_SAMPLES passes
        assert policy.plan_round(rows, proposals, [100] * 4, [3] * 4).draft_lengths == (0,) * 4
        assert policy.last_tokens_per_second["proposals"] > policy.last_tokens_per_second["plain"]
        policy.observe_pass(4, 1, 100, batched_verify_cost(costs, 4, 1, 100))  # as predicted
    assert policy.calibration.plain_passes == {4: PLAIN_SAMPLES}
    assert policy.plan_round(rows, proposals, [100] * 4, [3] * 4).draft_lengths == (3,) * 4
    # Three rows, drafted passes measured dear (2x): once the plain pass has run, at a
    # tenth of the price it borrowed from them, every round of three stays plain.
    for extra in range(1, 10):
        widths = [1 + extra, 1, 1]
        policy.observe_pass(3, max(widths), 100, 2 * packed_verify_cost(costs, widths, 100))
    for _ in range(PLAIN_SAMPLES):
        policy.observe_pass(3, 1, 100, 0.2 * batched_verify_cost(costs, 3, 1, 100))
    assert policy.plan_round(rows[:3], proposals[:3], [100] * 3, [3] * 3).draft_lengths == (0,) * 3
    # (the best allocation is now none: the plain round itself; or the search was skipped,
    # its bound below the plain round's)
    plain = policy.last_tokens_per_second["plain"]
    assert policy.last_tokens_per_second.get("proposals", plain) == plain
    # Without exploration, the borrowed price decides at once.
    eager = CostModelBatchPolicy(costs, max_draft_length=3, explore_plain=False)
    eager.reset(4)
    assert eager.plan_round(rows, proposals, [100] * 4, [3] * 4).draft_lengths == (3,) * 4


def test_the_default_policy_speculates_only_with_lookup_and_a_cost_model() -> None:
    prompts = [REPEATING, REPEATING[3:]]
    plain = _decoder().generate(prompts, max_new_tokens=12)
    assert all(stats.drafted_tokens == 0 for stats in plain.stats)  # no cost model
    decoder = SpeculativeDecoder(tiny_model("llama", 3), cost_model=_width_costs(flat=16))
    result = decoder.generate(prompts, max_new_tokens=12)
    _assert_rows_equal_alone("llama", prompts, result, 12)
    assert sum(stats.accepted_tokens for stats in result.stats) > 0


# ------------------------------------------------------------------ packed products
@given(
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 99),
    attention=st.sampled_from(["auto", "padded", "split"]),
)
def test_packed_products_give_the_padded_pass_at_every_real_token(
    widths: list[int], seed: int, attention: AttentionLayout
) -> None:
    """A ragged pass with ``widths`` (products over the real tokens only), attending in
    one padded call or split (first tokens batched, later queries row by row), gives the
    same logits and the same K/V at every real position as the padded pass over
    ``rows × max(widths)`` tokens."""
    from knapspec.model.passes.batched import forward_batch, new_batch_cache

    engine = _decoder().engine
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(widths), max(widths)
    contexts = [int(torch.randint(1, 20, (1,), generator=generator)) for _ in widths]
    caches = []
    for _ in range(2):
        cache = new_batch_cache(engine, rows, 32)
        for row, context in enumerate(contexts):
            single = engine.new_cache(32)
            prompt = torch.randint(0, 97, (context,), generator=torch.Generator().manual_seed(row))
            engine.forward(prompt, 0, single, all_logits=False)
            cache.load_row(row, single, context)
        caches.append(cache)
    inputs = torch.randint(0, 97, (rows, width), generator=generator)
    padded = forward_batch(engine, inputs, contexts, caches[0])
    packed = forward_batch(engine, inputs, contexts, caches[1], widths=widths, attention=attention)
    for cache in caches:
        cache.set_lengths(list(contexts))  # the pass left the lengths to the caller
    flat = forward_batch(
        engine, inputs, contexts, caches[1], widths=widths, packed_logits=True, attention=attention
    )
    assert flat.shape == (sum(widths), padded.shape[-1])
    torch.testing.assert_close(
        flat,
        torch.cat([padded[row, :real] for row, real in enumerate(widths)]),
        atol=1e-4,
        rtol=1e-4,
    )
    caches[1].set_lengths(list(contexts))
    last = forward_batch(
        engine, inputs, contexts, caches[1], widths=widths, all_logits=False, attention=attention
    )
    for row, real in enumerate(widths):  # each row's last *real* token
        torch.testing.assert_close(last[row], padded[row, real - 1], atol=1e-4, rtol=1e-4)
    for row, real in enumerate(widths):
        torch.testing.assert_close(packed[row, :real], padded[row, :real], atol=1e-4, rtol=1e-4)
        end = contexts[row] + real
        for layer in range(engine.num_layers):
            torch.testing.assert_close(
                caches[1].keys(layer, end)[row],
                caches[0].keys(layer, end)[row],
                atol=1e-5,
                rtol=1e-4,
            )
            torch.testing.assert_close(
                caches[1].values(layer, end)[row],
                caches[0].values(layer, end)[row],
                atol=1e-5,
                rtol=1e-4,
            )


def test_a_ragged_pass_attends_row_by_row_only_where_padding_doubles_the_queries() -> None:
    """One row drafting 4 beside three plain rows pads 20 queries for 8 real ones: row by
    row; near-equal widths, and a single row, stay one padded call."""
    assert splits_attention(4, 5, 8)
    assert splits_attention(3, 11, 13)
    assert not splits_attention(2, 11, 12)  # (11, 1): 22 padded queries for 12
    assert not splits_attention(4, 4, 14)
    assert not splits_attention(1, 11, 11)
    assert not splits_attention(3, 1, 3)


class _AttentionCosts(VerifyCurveCostModel):
    """Products cost 1 s per 4 tokens (at least 1 s); attention 1 ms per token and 100
    cached positions."""

    def __init__(self) -> None:
        super().__init__(lambda tokens: max(1.0, tokens / 4))

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return self.curve(tokens) + 1e-5 * tokens * context_length


@given(widths=st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_a_round_is_priced_as_it_attends_and_alike_by_search_and_calibration(
    widths: list[int],
) -> None:
    """Row by row, each row pays attention at its own width; padded, every row at the
    widest; the policy's search (RoundPrices) and the calibration (packed_verify_cost)
    price the same round alike."""
    costs, context = _AttentionCosts(), 1000
    rows, width, tokens = len(widths), max(widths), sum(widths)
    split = splits_attention(rows, width, tokens)
    attention = [row_attention_cost(costs, w, context) for w in widths]
    assert attention == pytest.approx([0.01 * w for w in widths])
    expected = costs.curve(tokens) + (sum(attention) if split else rows * 0.01 * width)
    assert packed_verify_cost(costs, widths, context) == pytest.approx(expected)
    prices = RoundPrices(costs, rows, context, BatchPassCalibration(), BatchPassCalibration(), None)
    assert prices.round(tokens, width, 0, sum(attention)) == pytest.approx(expected)


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    data=st.data(),
)
def test_keep_moves_each_kept_row_whole(lengths: list[int], data: st.DataObject) -> None:
    """After ``keep(rows)`` slot ``i`` holds row ``rows[i]``'s valid tokens and length, for
    the hole-filling orders retirement uses and for any other order (a gather)."""
    cache = BatchKVCache(2, len(lengths), 2, 4, 12, dtype=torch.float32, device=torch.device("cpu"))
    for layer in range(2):
        cache._keys[layer].normal_()
        cache._values[layer].normal_()
    cache.set_lengths(lengths)
    before_keys = [k.clone() for k in cache._keys]
    before_values = [v.clone() for v in cache._values]
    rows = data.draw(st.permutations(range(len(lengths))))
    rows = rows[: data.draw(st.integers(0, len(rows)))]
    cache.keep(list(rows))
    assert cache.lengths == [lengths[row] for row in rows]
    for slot, row in enumerate(rows):
        n = lengths[row]
        for layer in range(2):
            assert torch.equal(cache._keys[layer][slot, :, :n], before_keys[layer][row, :, :n])
            assert torch.equal(cache._values[layer][slot, :, :n], before_values[layer][row, :, :n])


def test_a_retirement_moves_only_the_last_rows_into_the_holes() -> None:
    """Rows 1 and 3 of 6 stop: rows 4 and 5 fill their slots, rows 0 and 2 stay put."""
    active = [10, 11, 12, 13, 14, 15]

    class _Stats:
        def __init__(self, stop: str) -> None:
            self.stop_reason = stop
            self.wall_time_s = 0.0

    class _Row:
        def __init__(self, stop: str) -> None:
            self.stats = _Stats(stop)
            self.stopped = bool(stop)

    class _Cache:
        def __init__(self) -> None:
            self.kept: list[int] = []

        def keep(self, rows: list[int]) -> None:
            self.kept = rows

    bare = object.__new__(ContinuousBatch)
    stopped = {11, 13}
    bare.rows = {row: _Row("eos" if row in stopped else "") for row in active}  # type: ignore[assignment]
    bare._now = lambda: 1.0  # type: ignore[method-assign]
    cache = _Cache()
    bare._active, bare._cache, bare.started = active, cache, 0.0  # type: ignore[assignment]
    bare._retire()
    assert cache.kept == [0, 4, 2, 5]
    assert active == [10, 14, 12, 15]
