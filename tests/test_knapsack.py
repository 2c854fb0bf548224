"""KnapsackPlanner and its re-planning policy on tiny random Llama models.

Costs come from a small analytic :class:`CostModel` (a test double of the interface; the
engine itself is real).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch

from knapspec.costmodels.base import CostModel
from knapspec.planners.base import PLANNERS, PlanningContext
from knapspec.planners.knapsack import KnapsackPlanner, KnapsackPlannerConfig
from knapspec.planners.objective import RoundCosts, grid_search
from knapspec.planners.replan import ReplanConfig, ReplanPolicy, ReplanReason
from knapspec.sampling import SamplingParams
from knapspec.types import DraftPlan, StepOutcome, SublayerMask
from test_dp import assert_cache_unchanged, cache_snapshot, filled, tiny_engine


@attrs.frozen
class AnalyticCostConfig:
    t_attn_base: float = 1.0
    t_attn_per_token: float = 0.0
    t_mlp: float = 1.0
    overhead: float = 1.0
    verify_per_token: float = 0.0


class AnalyticCostModel(CostModel):
    """``t_attn = a + b·n``, constant ``t_mlp`` and overhead; verifying ``k`` tokens costs a
    plain step plus ``verify_per_token·(k - 1)``."""

    config_class = AnalyticCostConfig

    def __init__(self, config: AnalyticCostConfig, num_layers: int) -> None:
        self.c = config
        self.num_layers = num_layers

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return self.c.t_attn_base + self.c.t_attn_per_token * context_length

    def t_mlp(self, layer: int | None = None) -> float:
        return self.c.t_mlp

    def overhead(self, context_length: int) -> float:
        return self.c.overhead

    def verify_cost(self, tokens: int, context_length: int) -> float:
        step = self.overhead(context_length) + self.num_layers * (
            self.t_attn(context_length) + self.t_mlp()
        )
        return step + self.c.verify_per_token * (tokens - 1)


def context_for(
    num_layers: int = 4, seed: int = 0, cost: AnalyticCostConfig | None = None, **kwargs: Any
) -> PlanningContext:
    engine = tiny_engine(num_layers, seed)
    cache, window = filled(engine, 24, 6, seed)
    cost_model = None if cost is None else AnalyticCostModel(cost, num_layers)
    fields: dict[str, Any] = dict(
        engine=engine,
        cache=cache,
        context_length=24,
        window=window,
        cost_model=cost_model,
        proxy=None,
        max_draft_length=6,
        sampling=SamplingParams(),
    )
    fields.update(kwargs)
    return PlanningContext(**fields)


# A GPU-like machine: verification is free, the overhead tiny; speculation may pay.
CHEAP_VERIFY = AnalyticCostConfig(overhead=0.01, verify_per_token=0.0)
# This CPU: verifying k tokens costs far more than a step, skipping saves little.
CPU_LIKE = AnalyticCostConfig(t_attn_base=0.5, t_mlp=0.5, overhead=8.0, verify_per_token=4.0)


def test_registered_and_built_from_config() -> None:
    assert PLANNERS.get("knapsack") is KnapsackPlanner
    engine = tiny_engine(2, 0)
    planner = KnapsackPlanner.from_config(KnapsackPlannerConfig(tau=0.3, every_rounds=5), engine)
    assert planner.config.tau == 0.3 and planner.policy.config.every_rounds == 5
    with pytest.raises(ValueError):
        KnapsackPlannerConfig(budget_fraction=2.0)
    with pytest.raises(ValueError):
        KnapsackPlannerConfig(objective="speed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KnapsackPlannerConfig"):
        KnapsackPlanner.from_config(object(), engine)


def test_cpu_like_costs_choose_no_speculation_without_running_the_dp() -> None:
    context = context_for(cost=CPU_LIKE)
    planner = KnapsackPlanner()
    plan = planner.plan(context)
    assert plan.draft_length == 0 and plan.mask.is_full and plan.source == "knapsack"
    search = planner.last_search_
    assert search is not None and search.shortcut and search.dp is None
    assert plan.predicted_tokens_per_second == pytest.approx(1 / context.cost_model.step_cost(24))  # type: ignore[union-attr]


def test_plan_is_the_tpt_optimum_over_the_dp_candidates() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=3)
    planner = KnapsackPlanner(
        KnapsackPlannerConfig(pareto_candidates=False, amortise_planning=False)
    )
    before = cache_snapshot(context.cache)
    plan = planner.plan(context)
    assert_cache_unchanged(context.cache, before)
    search = planner.last_search_
    assert search is not None and search.dp is not None and search.grid is not None
    dp = search.dp
    assert plan.draft_length <= context.max_draft_length
    # Brute-force the grid over every candidate with the same α.
    costs = RoundCosts.from_cost_model(
        context.cost_model, [dp.masks[i] for i in search.candidates], 24, 6
    )  # type: ignore[arg-type]
    tables = [
        grid_search([alpha], RoundCosts(draft=costs.draft[[k]], verify=costs.verify)).table
        for k, alpha in enumerate(search.alphas)
    ]
    best = max(float(t.max()) for t in tables)
    assert search.grid.objective == pytest.approx(best)
    if plan.draft_length:
        assert plan.mask in dp.masks
        assert plan.predicted_acceptance is not None
        skipped_weight = sum(search.dp_weights[i] for i in plan.mask.skipped)
        assert skipped_weight <= search.max_budget


def test_acceptance_fallback_is_top1_agreement() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=4)
    planner = KnapsackPlanner(
        KnapsackPlannerConfig(pareto_candidates=False, acceptance_pseudo_counts=0.0)
    )
    planner.plan(context)
    search = planner.last_search_
    assert search is not None and search.dp is not None
    dp = search.dp
    states = dp.final_states[list(search.candidates)]
    agreement = (
        (context.engine.logits(states).argmax(-1) == dp.window.target_tokens).float().mean(-1)
    )
    np.testing.assert_allclose(search.alphas, agreement.numpy())
    # The full model (budget 0) agrees with itself on every window token.
    if 0 in search.candidates:
        assert search.alphas[search.candidates.index(0)] == pytest.approx(1.0)
    # With the default Laplace prior, α on r tokens is (r·α̂ + 1) / (r + 2).
    shrunk = KnapsackPlanner(KnapsackPlannerConfig(pareto_candidates=False))
    shrunk.plan(context)
    assert shrunk.last_search_ is not None
    r = dp.window.size
    np.testing.assert_allclose(shrunk.last_search_.alphas, (r * agreement.numpy() + 1) / (r + 2))


def test_tied_items_skip_whole_layers() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=5)
    planner = KnapsackPlanner(KnapsackPlannerConfig(decoupled=False, tau=None))
    planner.plan(context)
    search = planner.last_search_
    assert search is not None and search.dp is not None
    assert search.dp_weights == (1, 1, 1, 1)  # weight 2 per layer, divided by the gcd
    for mask in search.dp.masks:
        assert all(mask.attention(layer) == mask.mlp(layer) for layer in range(4))


def test_window_is_shortened_to_bound_the_batch() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=6)
    planner = KnapsackPlanner(KnapsackPlannerConfig(max_window_tokens=6, max_batch_rows=10))
    planner.plan(context)
    search = planner.last_search_
    assert search is not None and search.dp is not None
    # 4 layers, weights (1, 1): budgets 0..4 -> 5 live budgets, 10 rows -> 2 tokens.
    assert search.dp.window.size == 2


def test_tpt_needs_a_cost_model_but_tpl_does_not() -> None:
    context = context_for(cost=None)
    with pytest.raises(ValueError, match="needs a cost model"):
        KnapsackPlanner().plan(context)
    plan = KnapsackPlanner(KnapsackPlannerConfig(objective="tpl")).plan(context)
    assert plan.draft_length <= context.max_draft_length


def test_no_window_or_no_draft_length_means_plain_steps() -> None:
    planner = KnapsackPlanner()
    assert planner.plan(context_for(cost=CHEAP_VERIFY, window=None)).draft_length == 0
    assert planner.plans_made == 0  # nothing to plan on: retried next round
    plan = KnapsackPlanner().plan(context_for(cost=CHEAP_VERIFY, max_draft_length=0))
    assert plan.draft_length == 0


def test_without_the_fallback_the_planner_always_speculates() -> None:
    planner = KnapsackPlanner(KnapsackPlannerConfig(allow_no_speculation=False))
    plan = planner.plan(context_for(cost=CPU_LIKE, seed=7))
    assert plan.draft_length >= 1


def test_plans_are_reused_until_the_policy_triggers() -> None:
    context = context_for(cost=CPU_LIKE)
    planner = KnapsackPlanner(
        KnapsackPlannerConfig(
            every_rounds=3, max_planning_fraction=None, context_growth=None, max_backoff=0
        )
    )
    first = planner.plan(context)
    assert planner.plans_made == 1
    for _ in range(2):
        planner.update(StepOutcome(first, 24, 0, 0, 0.0, 0.01))
        assert planner.plan(context) is first
    planner.update(StepOutcome(first, 24, 0, 0, 0.0, 0.01))
    planner.plan(context)
    assert planner.plans_made == 2 and planner.last_reason_ is ReplanReason.PERIODIC
    planner.reset()
    assert planner.plans_made == 0


# ---------------------------------------------------------------------- re-planning policy
def speculative_plan(alpha: float) -> DraftPlan:
    return DraftPlan(SublayerMask.from_skipped(2, [1]), 4, predicted_acceptance=alpha)


def test_policy_triggers() -> None:
    policy = ReplanPolicy(
        ReplanConfig(
            context_growth=0.5,
            acceptance_drift=0.2,
            drift_min_rounds=2,
            every_rounds=10,
            max_planning_fraction=None,
            max_backoff=0,
        )
    )
    assert policy.decide(100, has_window=False) is None
    assert policy.decide(100, has_window=True) is ReplanReason.INITIAL
    policy.record_plan(speculative_plan(0.9), 100, 0.0)
    assert policy.decide(149, True) is None
    assert policy.decide(150, True) is ReplanReason.CONTEXT_GROWTH
    # Two rounds that each accepted 1 of 4 drafts: α ≈ 1 / 2 (one success, one failure).
    for _ in range(2):
        policy.observe(StepOutcome(speculative_plan(0.9), 100, 4, 1, 0.01, 0.01))
    assert policy.observed_acceptance == pytest.approx(0.5)
    assert policy.decide(100, True) is ReplanReason.ACCEPTANCE_DRIFT
    policy.record_plan(DraftPlan.autoregressive(2), 100, 0.0)
    for _ in range(9):
        policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 0.01))
    assert policy.decide(100, True) is None
    policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 0.01))
    assert policy.decide(100, True) is ReplanReason.PERIODIC


def test_time_budget_holds_back_replanning() -> None:
    policy = ReplanPolicy(ReplanConfig(every_rounds=1, max_planning_fraction=0.05, max_backoff=0))
    policy.record_plan(DraftPlan.autoregressive(2), 100, 1.0)
    # 1 s of planning may be at most 5 % of the total: 19 s of generation must pass first.
    for _ in range(18):
        policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 1.0))
        assert policy.decide(100, True) is None
    policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 1.0))
    assert policy.decide(100, True) is ReplanReason.PERIODIC


def test_policy_config_validation() -> None:
    with pytest.raises(ValueError, match="max_planning_fraction"):
        ReplanConfig(max_planning_fraction=1.5)
    with pytest.raises(ValueError, match="context_growth"):
        ReplanConfig(context_growth=0.0)
    with pytest.raises(ValueError):
        ReplanConfig(every_rounds=0)


def test_falling_acceptance_falls_back_to_plain_steps_within_the_time_budget() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=3)
    planner = KnapsackPlanner(KnapsackPlannerConfig(drift_min_rounds=2, acceptance_drift=0.2))
    plan = DraftPlan(SublayerMask.from_skipped(4, [1]), 4, predicted_acceptance=0.9)
    planner.policy.record_plan(plan, 24, 100.0)  # an expensive plan
    bad = StepOutcome(plan, 24, 4, 0, 0.01, 0.01)
    planner.update(bad)
    assert planner.plan(context).draft_length == 4  # one round is not evidence yet
    planner.update(bad)
    fallback = planner.plan(context)
    assert fallback.draft_length == 0 and planner.plans_made == 1  # no new search


def test_a_plan_below_its_break_even_acceptance_is_abandoned_after_one_round() -> None:
    """Posterior α with a 4-trial prior at the predicted 0.83: one round that accepts none
    of 3 drafts gives (4·0.83 + 0) / 5 = 0.664 < 0.7, so the plan is abandoned at once
    (without waiting for the drift rule's rounds), without a new search, and the policy
    backs off; a round that accepts all its drafts keeps the plan."""
    context = context_for(cost=CHEAP_VERIFY, seed=3)
    config = KnapsackPlannerConfig(drift_min_rounds=4, prior_trials=4.0)
    plan = DraftPlan(SublayerMask.from_skipped(4, [1]), 3, predicted_acceptance=0.83)

    planner = KnapsackPlanner(config)
    planner.policy.record_plan(plan, 24, 100.0, breakeven_acceptance=0.7)
    planner.update(StepOutcome(plan, 24, 3, 3, 0.01, 0.01))
    assert planner.policy.posterior_acceptance == pytest.approx((4 * 0.83 + 3) / 7)
    assert planner.plan(context) is plan

    planner = KnapsackPlanner(config)
    planner.policy.record_plan(plan, 24, 100.0, breakeven_acceptance=0.7)
    planner.update(StepOutcome(plan, 24, 3, 0, 0.01, 0.01))
    assert planner.policy.posterior_acceptance == pytest.approx(4 * 0.83 / 5)
    fallback = planner.plan(context)
    assert fallback.draft_length == 0 and planner.plans_made == 1
    assert planner.policy.abandoned_ == 1 and planner.policy.backoff_ == 1


def test_back_off_after_searches_that_do_not_pay_and_reset_after_one_that_does() -> None:
    policy = ReplanPolicy(
        ReplanConfig(
            every_rounds=4,
            max_planning_fraction=None,
            max_backoff=2,
            drift_min_rounds=2,
            context_growth=None,
        )
    )
    plain = DraftPlan.autoregressive(2)

    def rounds_until_replan() -> int:
        for count in range(1, 100):
            policy.observe(StepOutcome(plain, 100, 0, 0, 0.0, 0.01))
            if policy.decide(100, True) is ReplanReason.PERIODIC:
                return count
        raise AssertionError("never re-planned")

    intervals = []
    for _ in range(4):
        policy.record_plan(plain, 100, 0.0)  # each search ends at γ = 0
        intervals.append(rounds_until_replan())
    assert intervals == [8, 16, 16, 16]  # doubled, capped at 2 doublings
    good = speculative_plan(0.9)
    policy.record_plan(good, 100, 0.0, breakeven_acceptance=0.5)
    for _ in range(2):
        policy.observe(StepOutcome(good, 100, 4, 4, 0.01, 0.01))
    assert policy.backoff_ == 0 and policy.periodic_interval() == 4


def test_time_budget_wait_grows_with_the_back_off() -> None:
    policy = ReplanPolicy(ReplanConfig(every_rounds=1, max_planning_fraction=0.05, max_backoff=3))
    policy.record_plan(DraftPlan.autoregressive(2), 100, 1.0)  # γ = 0: one doubling
    assert policy.backoff_ == 1
    # 1 s of planning, 5 % budget, one doubling: 38 s of generation must pass first.
    for _ in range(37):
        policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 1.0))
        assert policy.decide(100, True) is None
    policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 1.0))
    assert policy.decide(100, True) is ReplanReason.PERIODIC


def test_a_draft_that_skips_nothing_is_never_chosen() -> None:
    """Even a cost model that prices a full-model draft step far below a plain step (as a
    profile taken under load can) must not make the planner 'speculate' with the target
    itself: that draft costs a full step per token whatever the model says."""

    class CheapDrafts(AnalyticCostModel):
        def verify_cost(self, tokens: int, context_length: int) -> float:
            return 50.0 + 0.1 * tokens  # a step costs far more than its items add up to

    context = context_for(cost=CHEAP_VERIFY)
    context = attrs.evolve(context, cost_model=CheapDrafts(CHEAP_VERIFY, 4))
    planner = KnapsackPlanner.from_config(KnapsackPlannerConfig(tau=None), context.engine)
    plan = planner.plan(context)
    assert plan.draft_length == 0 or plan.mask.num_skipped > 0
    search = planner.last_search_
    assert search is not None and search.dp is not None
    assert any(mask.num_skipped == 0 for mask in search.dp.masks)  # budget 0 was reachable
    assert all(search.dp.masks[i].num_skipped > 0 for i in search.candidates)


def test_a_plan_measured_slower_than_plain_steps_is_abandoned() -> None:
    """The wall clock has the last word: acceptance as predicted, but speculative rounds
    that commit tokens more slowly than the measured plain steps lose the plan."""
    config = ReplanConfig(drift_min_rounds=2, max_planning_fraction=None, context_growth=None)
    plan = speculative_plan(0.9)
    for round_seconds, abandoned in ((0.05, True), (0.02, False)):
        policy = ReplanPolicy(config)
        policy.record_plan(DraftPlan.autoregressive(2), 100, 0.0)
        for _ in range(3):  # plain steps of 10 ms: 100 tokens/s
            policy.observe(StepOutcome(DraftPlan.autoregressive(2), 100, 0, 0, 0.0, 0.01))
        policy.record_plan(plan, 100, 0.0, breakeven_acceptance=0.1)
        # 4 drafts, 3 accepted: 4 tokens per round, acceptance in line with the prediction.
        policy.observe(StepOutcome(plan, 100, 4, 3, round_seconds / 2, round_seconds / 2))
        assert not policy.acceptance_fell()  # one round is not enough evidence
        policy.observe(StepOutcome(plan, 100, 4, 3, round_seconds / 2, round_seconds / 2))
        # 4 tokens per 50 ms = 80 tokens/s < 100: abandon; 4 per 20 ms = 200 tokens/s: keep.
        assert policy.acceptance_fell() is abandoned


def test_a_marginal_predicted_gain_keeps_plain_steps() -> None:
    context = context_for(cost=CHEAP_VERIFY, seed=3)
    free = KnapsackPlanner(KnapsackPlannerConfig(tau=None, min_predicted_speedup=1.0))
    plan = free.plan(context)
    search = free.last_search_
    assert plan.draft_length > 0 and search is not None and search.grid is not None
    predicted = search.grid.objective * context.cost_model.step_cost(24)  # type: ignore[union-attr]
    strict = KnapsackPlanner(
        KnapsackPlannerConfig(tau=None, min_predicted_speedup=predicted * 1.01)
    )
    assert strict.plan(context).draft_length == 0


def test_the_copy_gate_searches_only_while_the_output_is_copied() -> None:
    copied = torch.tensor([*range(100, 140), 7, *range(100, 120)])
    fresh = torch.arange(1000, 1061)
    for tokens, searched in ((copied, True), (fresh, False)):
        planner = KnapsackPlanner(KnapsackPlannerConfig(search_gate="copy"))
        planner.plan(context_for(cost=CHEAP_VERIFY, seed=3, tokens=tokens))
        assert (planner.plans_made == 1) is searched
        assert planner.gated_rounds_ == (0 if searched else 1)
    always = KnapsackPlanner(KnapsackPlannerConfig(search_gate="always"))
    always.plan(context_for(cost=CHEAP_VERIFY, seed=3, tokens=fresh))
    assert always.plans_made == 1


def test_the_window_is_wanted_only_for_a_search_that_is_due() -> None:
    copied = torch.tensor([*range(100, 140), 7, *range(100, 120)])
    fresh = torch.arange(1000, 1061)
    gated = KnapsackPlanner(KnapsackPlannerConfig(search_gate="copy"))
    assert not gated.wants_window(fresh)  # no plan yet, but the gate is shut
    gated.reset()
    assert gated.wants_window(copied)  # the initial search is due and the gate is open
    # A plain plan just made: no search is due (the policy waits for context growth or
    # its interval), so even copied output is not recorded.
    plain = DraftPlan.autoregressive(4, source="knapsack")
    gated.policy.record_plan(plain, copied.numel(), 0.0, None, None)
    assert gated.policy.decide(copied.numel() + 1, has_window=True) is None
    assert not gated.wants_window(torch.cat([copied, torch.tensor([120])]))
    # A running speculative plan may be re-planned at any round: always record.
    gated.policy.record_plan(DraftPlan(SublayerMask.from_skipped(4, [1]), 2), 24, 0.0, None, None)
    assert gated.wants_window(torch.cat([fresh, torch.tensor([5000])]))
    always = KnapsackPlanner(KnapsackPlannerConfig(search_gate="always"))
    assert always.wants_window(fresh)
