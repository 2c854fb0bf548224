"""Drafters: the incremental lookup index against brute force, the lookup acceptance
estimates and TPT cut, and lookup drafting inside the decoder (lossless, priced)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.tiny_models import greedy_reference, tiny_model

from knapspec.config import ConfigError, DecoderConfig
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftRequest,
    LookupAcceptance,
    LookupConfig,
    LookupDrafter,
    LookupIndex,
)
from knapspec.drafters.acceptance import hindsight_matches
from knapspec.model.engine import SublayerEngine
from knapspec.planners import KnapsackPlanner, LookupPlanner
from knapspec.planners.knapsack import KnapsackPlannerConfig
from knapspec.planners.lookup import LookupPlannerConfig
from knapspec.planners.objective import (
    best_chained_length,
    chained_expected_tokens,
    expected_tokens,
)
from knapspec.registry import UnknownComponentError
from knapspec.testing import VerifyCurveCostModel, check_registration

token_lists = st.lists(st.integers(0, 4), min_size=1, max_size=60)


# ------------------------------------------------------------------ the lookup index
def _brute_longest(tokens: list[int], max_ngram: int) -> tuple[int, list[int]]:
    """Longest n <= N whose suffix occurs ending at some e < len - 1 (with a next token)."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            return n, ends
    return 0, []


@given(tokens=token_lists, max_ngram=st.integers(1, 5))
def test_longest_suffix_match_equals_brute_force(tokens: list[int], max_ngram: int) -> None:
    index = LookupIndex(max_ngram)
    index.extend(tokens)
    assert index.longest_suffix_match() == _brute_longest(tokens, max_ngram)


@given(tokens=token_lists, cut=st.integers(0, 60), max_tokens=st.integers(1, 8))
def test_incremental_index_equals_one_built_at_once(
    tokens: list[int], cut: int, max_tokens: int
) -> None:
    whole = LookupIndex(3)
    whole.extend(tokens)
    pieces = LookupIndex(3)
    pieces.extend(tokens[:cut])
    pieces.extend(tokens[cut:])
    assert pieces.propose(max_tokens) == whole.propose(max_tokens)


@given(tokens=token_lists, max_tokens=st.integers(1, 8), candidates=st.integers(1, 4))
def test_a_proposal_continues_an_earlier_occurrence_of_the_matched_suffix(
    tokens: list[int], max_tokens: int, candidates: int
) -> None:
    index = LookupIndex(3)
    index.extend(tokens)
    proposal, support, match = index.propose(max_tokens, max_candidates=candidates)
    n, ends = _brute_longest(tokens, 3)
    if n == 0:
        assert proposal == [] and match == 0
        return
    assert 1 <= len(proposal) <= max_tokens and len(support) == len(proposal)
    assert all(0.0 < s <= 1.0 for s in support)
    assert match >= n
    starts = [e + 1 for e in ends[-candidates:]]
    assert any(tokens[s : s + len(proposal)] == proposal for s in starts)


def test_the_proposal_prefers_the_longest_match_then_the_majority() -> None:
    index = LookupIndex(4)
    # "7 8" is followed by 1 twice and by 2 once; "9 7 8" (longer) by 3.
    index.extend([7, 8, 1, 0, 7, 8, 1, 0, 9, 7, 8, 3, 5, 7, 8, 2, 6, 9, 7, 8])
    proposal, _, match = index.propose(2)
    assert proposal == [3, 5] and match == 3
    index = LookupIndex(4)
    index.extend([7, 8, 1, 0, 6, 7, 8, 1, 4, 5, 7, 8, 2, 4, 0, 7, 8])
    proposal, support, _ = index.propose(1)
    assert proposal == [1] and support[0] == pytest.approx(2 / 3)


def test_the_lookup_drafter_is_registered_and_proposes_one_hot_drafts() -> None:
    drafter = DRAFTERS.get("lookup").from_config(LookupConfig(max_tokens=4), None)  # type: ignore[arg-type]
    assert isinstance(drafter, LookupDrafter)
    drafter.reset([1, 2, 3, 4, 5, 6, 1, 2])
    draft = drafter.propose(DraftRequest(10))
    assert draft.tokens == (3, 4, 5, 6) and draft.drafter == "lookup" and draft.seconds >= 0
    q = draft.draft_probs(8)
    assert torch.equal(q.argmax(-1), torch.tensor([3, 4, 5, 6])) and torch.all(q.sum(-1) == 1)
    assert draft.truncated(2).tokens == (3, 4)
    with pytest.raises(ValueError, match="max_match"):
        LookupConfig(max_ngram=5, max_match=4)


# --------------------------------------------------------- acceptance and the TPT cut
@given(
    alpha=st.floats(0, 1),
    length=st.integers(0, 12),
)
def test_chained_expectation_with_a_constant_rate_is_the_geometric_one(
    alpha: float, length: int
) -> None:
    chained = chained_expected_tokens([alpha] * length)
    assert chained == pytest.approx(expected_tokens(alpha, np.arange(length + 1)))


def _brute_expected(rates: list[float], gamma: int) -> float:
    """E[committed] by enumerating the first rejection position."""
    total, reach = 0.0, 1.0
    for j in range(gamma):
        total += reach * (1 - rates[j]) * (j + 1)  # j accepted, then a correction
        reach *= rates[j]
    return total + reach * (gamma + 1)  # all accepted, then a bonus token


@given(
    rates=st.lists(st.floats(0, 1), min_size=0, max_size=8),
    step=st.floats(0.5, 2.0),
    slope=st.floats(0.0, 1.0),
)
def test_the_best_cut_maximises_tokens_per_time_by_brute_force(
    rates: list[float], step: float, slope: float
) -> None:
    verify = [step * (1 + slope * k) for k in range(len(rates) + 1)]
    gamma, tpt = best_chained_length(rates, verify)
    brute = [_brute_expected(rates, g) / verify[g] for g in range(len(rates) + 1)]
    assert tpt == pytest.approx(brute)
    assert brute[gamma] == pytest.approx(max(brute))
    assert all(tpt[g] < tpt[gamma] for g in range(gamma))  # ties go to the smaller γ


@given(proposal=st.lists(st.integers(0, 3), max_size=6), committed=token_lists)
def test_hindsight_matches_counts_the_leading_agreement(
    proposal: list[int], committed: list[int]
) -> None:
    matched, rejected = hindsight_matches(proposal, committed)
    assert proposal[:matched] == committed[:matched]
    limit = min(len(proposal), len(committed))
    assert rejected == (matched < limit)


def test_acceptance_estimates_follow_the_evidence_per_bucket() -> None:
    estimator = LookupAcceptance()
    long_bucket = estimator.bucket(20, streak=False)
    short_bucket = estimator.bucket(1, streak=False)
    prior_long = estimator.conditional(long_bucket, 3)
    assert prior_long[0] > estimator.conditional(short_bucket, 3)[0]  # longer match, higher prior
    for _ in range(20):
        estimator.observe(short_bucket, 0, rejected=True)
        estimator.observe(long_bucket, 5, rejected=False)
    assert estimator.conditional(short_bucket, 1)[0] < 0.1
    assert estimator.conditional(long_bucket, 3)[0] > 0.9
    # Positions never tried fall back to the bucket's pooled rate, not to the prior.
    assert estimator.conditional(long_bucket, 12)[-1] > 0.9


def test_the_copy_streak_state_comes_from_the_last_round() -> None:
    estimator = LookupAcceptance()
    estimator.observe_round((4, 5, 6), 3, (4, 5))
    assert estimator.streak_
    estimator.observe_round((4, 5, 6), 3, (4, 9))
    assert not estimator.streak_
    assert estimator.observed_rounds_ == 2


# ------------------------------------------------------------------ in the decoder
REPETITIVE = torch.tensor([5, 17, 23, 42, 8, 61, 3, 9, 30, 11] * 6)


def _flat_costs(slope: float) -> VerifyCurveCostModel:
    """Verification of ``k`` tokens costs ``1 + slope·(k - 1)`` steps."""
    return VerifyCurveCostModel(lambda tokens: 1.0 + slope * (tokens - 1))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_fixed_length_lookup_is_lossless_and_drafts(k: int) -> None:
    model = tiny_model("llama", 3)
    decoder = SpeculativeDecoder(model, planner=LookupPlanner(LookupPlannerConfig(k)))
    result = decoder.generate(REPETITIVE, max_new_tokens=40)
    assert torch.equal(result.tokens, greedy_reference(model, REPETITIVE, 40))
    counts = result.stats.drafters["lookup"]
    assert counts.rounds > 0 and counts.drafted > 0
    assert max(result.stats.accept_lengths) <= k + 1
    assert result.stats.lookup_time_s > 0


def _combined(
    slope: float, drafters: tuple[str, ...] = ("subnetwork", "lookup")
) -> KnapsackPlanner:
    return KnapsackPlanner(KnapsackPlannerConfig(drafters=drafters, search_gate="copy"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_combined_search_drafts_lookup_tokens_when_verification_is_cheap(family: str) -> None:
    model = tiny_model(family, 3)
    decoder = SpeculativeDecoder(model, planner=_combined(0.05), cost_model=_flat_costs(0.05))
    result = decoder.generate(REPETITIVE, max_new_tokens=40)
    assert torch.equal(result.tokens, greedy_reference(model, REPETITIVE, 40))
    lookup = result.stats.drafters["lookup"]
    assert lookup.drafted >= 6 and lookup.accepted > 0
    assert any(plan.drafter == "lookup" for plan in result.stats.plans)


def test_gamma_zero_wins_when_verifying_costs_as_much_as_stepping_and_says_why() -> None:
    model = tiny_model("llama", 3)
    decoder = SpeculativeDecoder(model, planner=_combined(1.0), cost_model=_flat_costs(1.0))
    result = decoder.generate(REPETITIVE, max_new_tokens=20)
    assert torch.equal(result.tokens, greedy_reference(model, REPETITIVE, 20))
    assert result.stats.drafted_tokens == 0
    assert set(result.stats.drafters) == {"none"}
    speedup = result.stats.best_rejected_draft_speedup
    assert speedup is not None and speedup <= 1.0
    assert "γ = 0 every round" in result.stats.summary()
    assert f"{speedup:.2f}x" in result.stats.summary()


def test_the_ablation_without_lookup_never_drafts_lookup_tokens() -> None:
    model = tiny_model("llama", 3)
    planner = _combined(0.05, drafters=("subnetwork",))
    assert planner.proposal_drafters() == frozenset()
    decoder = SpeculativeDecoder(model, planner=planner, cost_model=_flat_costs(0.05))
    result = decoder.generate(REPETITIVE, max_new_tokens=20)
    assert "lookup" not in result.stats.drafters
    assert result.stats.lookup_time_s == 0


@pytest.mark.parametrize(("prior", "drafts"), [(0.02, False), (0.98, True)])
def test_the_lookup_priors_of_the_config_price_the_drafts(prior: float, drafts: bool) -> None:
    # Priors a million trials strong outweigh what 30 rounds observe: the decision is the
    # configured prior's (at 5 % per extra verified token, 0.02 never pays, 0.98 does).
    config = DecoderConfig.from_dict(
        {
            "planner": {
                "name": "knapsack",
                "drafters": ["lookup"],
                "lookup_prior_acceptance": [prior] * 6,
                "lookup_prior_strength": 1e6,
                "lookup_position_strength": 1e6,
            }
        }
    )
    model = tiny_model("llama", 3)
    decoder = SpeculativeDecoder(model, config, cost_model=_flat_costs(0.05))
    result = decoder.generate(REPETITIVE, max_new_tokens=30)
    assert torch.equal(result.tokens, greedy_reference(model, REPETITIVE, 30))
    assert (result.stats.drafted_tokens > 0) == drafts


def test_the_lookup_section_sets_the_proposal_length() -> None:
    config = DecoderConfig.from_dict(
        {
            "planner": {"name": "lookup", "draft_length": 10},
            "drafters": {"lookup": {"max_tokens": 2}},
        }
    )
    model = tiny_model("llama", 3)
    result = SpeculativeDecoder(model, config).generate(REPETITIVE, max_new_tokens=30)
    assert torch.equal(result.tokens, greedy_reference(model, REPETITIVE, 30))
    assert result.stats.drafters["lookup"].drafted > 0
    assert max(result.stats.accept_lengths) <= 3  # two lookup tokens and the target's


def test_a_planner_may_only_read_proposals_of_registered_proposing_drafters() -> None:
    model = tiny_model("llama", 3)
    with pytest.raises(ConfigError, match="does not propose before planning"):
        SpeculativeDecoder(model, {"planner": {"name": "lookup", "drafter": "subnetwork"}})
    with pytest.raises(UnknownComponentError, match="did you mean 'lookup'"):
        SpeculativeDecoder(model, {"planner": {"name": "lookup", "drafter": "lookp"}})


@pytest.mark.parametrize("name", DRAFTERS.names())
def test_registration_contract(name: str) -> None:
    check_registration(DRAFTERS, name, Drafter, SublayerEngine(tiny_model("llama", 2)))


def test_knapsack_planner_refuses_unknown_drafters() -> None:
    with pytest.raises(ValueError, match="twice"):
        KnapsackPlannerConfig(drafters=("lookup", "lookup"))
    with pytest.raises(ValueError, match="non-empty"):
        KnapsackPlannerConfig(drafters=("subnetwork", ""))
    # Any registered proposing drafter may be named, so an unknown one is refused when
    # the decoder builds it, naming it.
    config = {"planner": {"name": "knapsack", "drafters": ["subnetwork", "medusa"]}}
    with pytest.raises(UnknownComponentError, match="medusa"):
        SpeculativeDecoder(tiny_model("llama", 2), config)


def test_a_draft_record_truncates_its_distributions_too() -> None:
    probs = torch.softmax(torch.randn(3, 5), -1)
    draft = Draft((1, 2, 3), "subnetwork", probs=probs)
    cut = draft.truncated(2)
    assert cut.tokens == (1, 2) and cut.probs is not None and torch.equal(cut.probs, probs[:2])
    assert draft.truncated(5) is draft
