"""Layer-skipping sub-network drafts in batches: the rows that draft with the shared mask
stay lossless (greedy: each row equals its prompt decoded alone; sampling: distributed as
the target), every row caches exactly its accepted tokens after every round, and the
batch-level policy prices the sub-network against lookup drafts and γ = 0."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tests.test_batch import REPEATING, _assert_rows_equal_alone, checked_rounds
from tests.test_sampling import (
    _chi_square_pvalue,
    _exact_joint,
    _small_vocab_model,
    accept_every_keyed_draft,
    counting,
)
from tests.tiny_models import tiny_model

from knapspec.decoding.continuous import ContinuousBatch
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.decoding.sampler import TokenSampler
from knapspec.drafters.base import LOOKUP, SUBNETWORK, Draft
from knapspec.planners import StaticPlanner
from knapspec.planners.batch.policy import (
    BatchSubnetwork,
    CostModelBatchPolicy,
    FixedSubnetworkBatchPolicy,
    RoundPlan,
    SubnetworkAcceptance,
    batched_draft_cost,
    packed_verify_cost,
)
from knapspec.planners.objective import chained_expected_tokens
from knapspec.sampling import SamplingParams
from knapspec.testing import CheapDraftCostModel, VerifyCurveCostModel
from knapspec.types import SublayerMask

LAYERS = 3


def _static_decoder(
    skipped: tuple[int, ...], gamma: int = 3, **kwargs: object
) -> SpeculativeDecoder:
    mask = SublayerMask.from_skipped(LAYERS, skipped)
    return SpeculativeDecoder(
        tiny_model("llama", LAYERS),
        planner=StaticPlanner(mask, gamma),
        **kwargs,  # type: ignore[arg-type]
    )


def _subnetwork_rounds(result_stats: list) -> int:  # type: ignore[type-arg]
    return sum(s.drafters[SUBNETWORK].drafted for s in result_stats if SUBNETWORK in s.drafters)


prompt_lists = st.lists(
    st.one_of(
        st.lists(st.integers(0, 96), min_size=1, max_size=14),
        st.integers(0, 20).map(lambda cut: REPEATING[cut : cut + 14]),
    ),
    min_size=2,
    max_size=4,
)


@given(
    prompts=prompt_lists,
    new=st.integers(3, 12),  # the prefill's token, then room for a draft
    gamma=st.integers(1, 4),
    skipped=st.sets(st.integers(0, 2 * LAYERS - 1), max_size=2 * LAYERS).map(
        lambda s: tuple(sorted(s))
    ),
)
def test_each_greedy_row_with_subnetwork_drafts_equals_its_prompt_alone(
    prompts: list[list[int]], new: int, gamma: int, skipped: tuple[int, ...]
) -> None:
    decoder = _static_decoder(skipped)
    result = decoder.generate_batch(
        prompts, max_new_tokens=new, policy=FixedSubnetworkBatchPolicy(gamma)
    )
    _assert_rows_equal_alone("llama", prompts, result, new)
    assert _subnetwork_rounds(result.stats) > 0  # the sub-network really drafted
    assert all(set(s.drafters) <= {SUBNETWORK, "none"} for s in result.stats)


def test_subnetwork_rounds_keep_exactly_each_rows_accepted_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds = checked_rounds(monkeypatch)
    # Skipping one MLP of three keeps some drafts right and gets others wrong.
    decoder = _static_decoder((3,))
    prompts = [REPEATING, [4, 4, 4, 4, 4, 4, 4, 4], [60, 2, 7], REPEATING[5:17]]
    result = decoder.generate_batch(
        prompts, max_new_tokens=16, policy=FixedSubnetworkBatchPolicy(4)
    )
    _assert_rows_equal_alone("llama", prompts, result, 16)
    drafted = [r for r in rounds if any(d > 0 for d, _ in r)]
    assert drafted, "no round drafted"
    partial = [(d, a) for r in drafted for d, a in r if d > 0 and a < d]
    full = [(d, a) for r in drafted for d, a in r if d > 0 and a == d]
    assert partial and full, f"want rejected and fully accepted sub-network drafts: {rounds}"


def test_the_subnetwork_mask_comes_from_the_planner_on_the_first_row() -> None:
    decoder = _static_decoder((1, 4), gamma=2)
    seen: list[BatchSubnetwork | None] = []
    original = ContinuousBatch._round

    def spy(self):  # type: ignore[no-untyped-def]
        seen.append(self.subnetwork)
        original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ContinuousBatch, "_round", spy)
        decoder.generate_batch(
            [[1, 2, 3], [4, 5]], max_new_tokens=4, policy=FixedSubnetworkBatchPolicy(2)
        )
    assert seen and all(s is not None for s in seen)
    offered = seen[0]
    assert offered is not None
    assert offered.mask.skipped == (1, 4) and offered.source == "static"
    # A planner that never drafts with the sub-network offers none: nothing is drafted.
    plain = SpeculativeDecoder(tiny_model("llama", LAYERS))  # knapsack: γ = 0 here
    plain.planner = StaticPlanner(SublayerMask.full(LAYERS), 0)
    result = plain.generate_batch(
        [[1, 2, 3], [4, 5]], max_new_tokens=4, policy=FixedSubnetworkBatchPolicy(2)
    )
    assert all(s.drafted_tokens == 0 for s in result.stats)


# ------------------------------------------------------------------ sampling
PROMPTS = [[1, 4, 2, 0, 3], [2, 2, 5, 1, 2, 2, 5, 1, 2, 2]]
LENGTH = 5  # token 1 from the prefill; tokens 2-4 drafted in one round, 5 its bonus
RUNS = 2000


def _subnetwork_samples(
    runs: int, skipped: tuple[int, ...], scheme: str = "position-keyed"
) -> tuple[list[Counter[tuple[int, ...]]], list[int]]:
    mask = SublayerMask.from_skipped(3, skipped)
    decoder = SpeculativeDecoder(_small_vocab_model(), planner=StaticPlanner(mask, 3))
    params = SamplingParams(do_sample=True, temperature=1.0, verification=scheme)
    counts: list[Counter[tuple[int, ...]]] = [Counter() for _ in PROMPTS]
    per_round: list[int] = []
    original = TokenSampler.verify  # as patched by the caller, if it patched it

    def counting(self, draft, logits, position):  # type: ignore[no-untyped-def]
        per_round.append(len(draft))
        return original(self, draft, logits, position)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenSampler, "verify", counting)
        for run in range(runs):
            result = decoder.generate_batch(
                PROMPTS,
                max_new_tokens=LENGTH,
                sampling=params,
                seeds=[2 * run, 2 * run + 1],
                policy=FixedSubnetworkBatchPolicy(3),
            )
            for row, tokens in enumerate(result.tokens):
                counts[row][tuple(tokens.tolist())] += 1
    return counts, per_round


@pytest.mark.parametrize(
    "scheme", ["position-keyed", pytest.param("rejection", marks=pytest.mark.slow)]
)
def test_sampled_rows_with_subnetwork_drafts_are_distributed_as_the_target(scheme: str) -> None:
    counts, per_round = _subnetwork_samples(RUNS, (1, 2), scheme)
    # Every first round drafts 3 tokens per row (5 new tokens leave room for 3).
    assert sum(1 for k in per_round if k >= 3) >= 2 * RUNS
    params = SamplingParams(do_sample=True, temperature=1.0)
    model = _small_vocab_model()
    for row, prompt in enumerate(PROMPTS):
        joint = _exact_joint(model, prompt, params, LENGTH)
        assert _chi_square_pvalue(counts[row], joint) > 1e-3, f"row {row}"


def test_the_subnetwork_chi_square_check_has_power_against_a_lossy_verifier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepting every sub-network draft token (drawn from the draft's q with the keyed
    noise) is caught; the draft skips every item but the last MLP, so its q is far from
    the target's."""
    verdicts = counting(monkeypatch, TokenSampler, "verify", accept_every_keyed_draft)
    counts, _ = _subnetwork_samples(RUNS, (0, 1, 2, 3, 4))
    assert any(verdict.accepted for verdict in verdicts), "no draft met the lossy verifier"
    params = SamplingParams(do_sample=True, temperature=1.0)
    joint = _exact_joint(_small_vocab_model(), PROMPTS[0], params, LENGTH)
    assert _chi_square_pvalue(counts[0], joint) < 1e-6


# ------------------------------------------------------------------ the policy
MASK = SublayerMask.from_skipped(LAYERS, (0, 2, 4))  # every attention item skipped


def _policy(
    costs: VerifyCurveCostModel | CheapDraftCostModel, alpha: float
) -> CostModelBatchPolicy:
    # The search's pricing alone: no plain pass is run first to measure it.
    policy = CostModelBatchPolicy(costs, max_draft_length=4, explore_plain=False)
    policy.reset(8)
    policy.use_subnetwork(BatchSubnetwork(MASK, prior_acceptance=alpha, prior_tokens=4.0))
    return policy


def test_a_cheap_accurate_subnetwork_drafts_and_a_dear_one_does_not() -> None:
    cheap = _policy(CheapDraftCostModel(LAYERS), alpha=0.8)
    plan = cheap.plan_round([0, 1], [Draft((), LOOKUP)] * 2, [100, 120], [4, 2])
    assert plan.subnetwork_rows == (True, True)
    assert plan.draft_lengths == (4, 2)  # each row within its room
    assert plan.draft_steps == 4
    # Sublayers cost 0.1 s each and a step ~1 s: a draft token costs a third of a step,
    # so a sub-network that is rarely right is not worth running.
    dear = _policy(VerifyCurveCostModel(lambda tokens: 1.0), alpha=0.2)
    plan = dear.plan_round([0, 1], [Draft((), LOOKUP)] * 2, [100, 120], [4, 4])
    assert plan == RoundPlan.lookup([0, 0])


def test_each_row_takes_the_better_of_its_lookup_draft_and_the_subnetwork() -> None:
    policy = _policy(CheapDraftCostModel(LAYERS), alpha=0.3)
    # Row 0's lookup proposal has a long match (high prior acceptance); row 1 has none.
    proposals = [Draft((1, 2, 3, 4), LOOKUP, match_length=16), Draft((), LOOKUP)]
    plan = policy.plan_round([0, 1], proposals, [100, 100], [4, 4])
    assert plan.subnetwork_rows == (False, True)
    assert plan.draft_lengths[0] > 0 and plan.draft_lengths[1] > 0


def test_a_wide_batch_under_width_priced_verification_does_not_draft() -> None:
    """Verification memory-bound up to 4 tokens, then paid per token: one row drafts,
    eight rows do not (each extra token costs a full row of products)."""
    costs = VerifyCurveCostModel(lambda tokens: max(1.0, tokens / 4))
    one = _policy(costs, alpha=0.9)
    assert one.plan_round([0], [Draft((), LOOKUP)], [100], [4]).draft_steps > 0
    eight = _policy(costs, alpha=0.9)
    rows = list(range(8))
    assert eight.plan_round(rows, [Draft((), LOOKUP)] * 8, [100] * 8, [4] * 8).draft_steps == 0


def test_subnetwork_acceptance_is_a_beta_posterior_with_one_rejection_per_short_round() -> None:
    estimate = SubnetworkAcceptance(prior_acceptance=0.5, prior_tokens=4.0)
    assert estimate.rate == pytest.approx(0.5)
    estimate.observe(drafted=4, accepted=4)  # all accepted: no rejection
    assert estimate.rate == pytest.approx((2.0 + 4) / (4 + 4))
    estimate.observe(drafted=4, accepted=1)  # one accepted, then a rejection
    assert estimate.rate == pytest.approx((2.0 + 5) / (4 + 5 + 1))
    with pytest.raises(ValueError, match="prior_acceptance"):
        BatchSubnetwork(MASK, prior_acceptance=1.0)


def test_batched_draft_cost_scales_products_like_verification_and_attention_per_row() -> None:
    costs = VerifyCurveCostModel(lambda tokens: 1.0 + 0.5 * (tokens - 1))
    single = batched_draft_cost(costs, MASK, 1, 100)
    assert single == pytest.approx(costs.draft_cost(MASK, 100))
    # No attention item runs and t_attn is flat here: only the products scale, as v(k).
    assert batched_draft_cost(costs, MASK, 4, 100) == pytest.approx(single * 2.5)


def test_the_default_policy_drafts_the_planners_subnetwork_when_it_pays() -> None:
    prompts = [REPEATING, REPEATING[3:], [9, 1, 5]]
    decoder = _static_decoder((3,), gamma=3, cost_model=CheapDraftCostModel(LAYERS))
    result = decoder.generate(prompts, max_new_tokens=12)
    _assert_rows_equal_alone("llama", prompts, result, 12)
    assert _subnetwork_rounds(result.stats) > 0


class _LastRowFirst(FixedSubnetworkBatchPolicy):
    """Round 1: only the last row drafts (it runs ahead); then only the first row."""

    def reset(self, rows: int) -> None:
        self.rounds = 0

    def plan_round(self, rows, proposals, context_lengths, rooms):  # type: ignore[no-untyped-def]
        self.rounds += 1
        plan = super().plan_round(rows, proposals, context_lengths, rooms)
        keep = len(rows) - 1 if self.rounds == 1 else 0
        lengths = tuple(g if slot == keep else 0 for slot, g in enumerate(plan.draft_lengths))
        return RoundPlan(lengths, tuple(g > 0 for g in lengths))


def test_a_row_at_the_context_limit_caps_the_shared_draft_steps() -> None:
    """The batch's sub-network steps run on every row, so a row that ran ahead to the
    model's context limit caps them for all: the first row's draft is cut, nothing
    steps past the context, and every row stays lossless."""
    decoder = _static_decoder(())  # the full model as its own draft: always accepted
    limit = decoder.engine.max_context
    new = 8
    prompts = [REPEATING[:9], [5, 6] * ((limit - new) // 2)]
    assert len(prompts[1]) + new == limit
    result = decoder.generate_batch(prompts, max_new_tokens=new, policy=_LastRowFirst(4))
    _assert_rows_equal_alone("llama", prompts, result, new)
    # Round 2: row 0 has room for 4 but row 1 sits 2 positions short of the limit, so 2
    # steps; round 3: room 2, row 1 one position short, so 1 step.
    assert result.stats[0].drafters[SUBNETWORK].drafted == 3
    assert result.stats[0].drafted_at_position == [2, 1]


# ------------------------------------------------------------------ per-row lookup lengths
@given(
    rates=st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=3),
    per_token=st.floats(0.0, 0.6),
    attention=st.floats(0.0, 0.5),
)
# Found by CI's hypothesis run: the largest increments first spread 3 tokens over two rows
# (padded attention) where one row drafting all 3 attends row by row and costs less.
@example(rates=[[], [1.0], [1.0, 1.0, 1.0]], per_token=0.0, attention=0.5)
@example(rates=[[], [1.0], [0.999, 0.999, 0.999]], per_token=0.0, attention=0.5)
def test_per_row_lookup_lengths_match_a_brute_force_over_every_allocation(
    rates: list[list[float]], per_token: float, attention: float
) -> None:
    """The policy's lookup lengths reach the highest tokens per second of any allocation
    (brute force over every γ vector), under packed products that cost per token and an
    attention term that grows with the padded width."""

    class Costs(VerifyCurveCostModel):
        def verify_cost(self, tokens: int, context_length: int) -> float:
            return 1.0 + per_token * (tokens - 1) + attention * tokens * (context_length > 0)

    costs = Costs(lambda tokens: 1.0)
    policy = CostModelBatchPolicy(costs, max_draft_length=4, margin=0.0, explore_plain=False)
    policy.reset(len(rates))
    gains = [chained_expected_tokens(row) for row in rates]
    lengths = [len(row) for row in rates]
    policy._lookup_gains = lambda rows, proposals: (gains, lengths)  # type: ignore[method-assign]
    proposals = [Draft(tuple(range(n)), LOOKUP) for n in lengths]
    chosen = policy.draft_lengths(list(range(len(rates))), proposals, [100] * len(rates))

    def speed(gammas: tuple[int, ...]) -> float:
        widths = [1 + g for g in gammas]
        tokens = sum(float(gain[g]) for gain, g in zip(gains, gammas, strict=True))
        return tokens / packed_verify_cost(costs, widths, 100)

    best = max(speed(g) for g in itertools.product(*(range(n + 1) for n in lengths)))
    assert speed(tuple(chosen)) == pytest.approx(best, rel=1e-9)
    assert all(0 <= g <= n for g, n in zip(chosen, lengths, strict=True))
    assert np.isfinite(best)


def test_a_row_that_copies_drafts_more_than_a_row_that_does_not() -> None:
    """Packed products price each row's tokens on their own: a row whose lookup matches
    16 tokens drafts long, a row with a 1-token match drafts little or nothing."""
    costs = VerifyCurveCostModel(lambda tokens: 1.0 + 0.08 * (tokens - 1))
    policy = CostModelBatchPolicy(costs, max_draft_length=6, explore_plain=False)
    policy.reset(2)
    proposals = [
        Draft(tuple(range(6)), LOOKUP, match_length=16),
        Draft(tuple(range(6)), LOOKUP, match_length=1),
    ]
    long, short = policy.draft_lengths([0, 1], proposals, [100, 100])
    assert long > short and long >= 3
