"""KnapSpec's planner: knapsack DP over sublayers, then a TPT grid search over drafts × γ.

One plan (method spec §5-6):

1. integer item weights from the cost model at the current context length ``n``
   (``w_attn``, ``w_mlp``; a sliding-window layer's attention its own, lighter past the
   window: :meth:`~knapspec.costmodels.base.CostModel.item_weights`; whole layers weigh
   their sum when attention and MLP are tied), divided by their common divisor (the same
   problem with fewer budgets);
2. a **provable shortcut**: with the draft cost as low as any budget allows and perfect
   acceptance (α = 1), can speculation beat a plain step at all? If not, return γ = 0
   without running the model (one additive knapsack over item times, microseconds);
3. the batched hidden-state DP (:func:`~knapspec.planners.dp.hidden_state_dp`) on the last
   few window tokens: one candidate mask per reachable skipped weight;
4. candidate filtering: drop candidates that cannot beat a plain step even at α = 1
   (provable), and — by default — candidates dominated in (score, draft cost) (a
   heuristic: it assumes acceptance does not fall as the score rises);
5. α of the remaining candidates from the value proxy (batched), and the grid search over
   candidates × γ ∈ {0..D} maximising TPT with the cost model's draft, verify and overhead
   costs plus the amortised planning time. γ = 0 wins whenever speculation does not pay.

Re-planning is governed by :class:`~knapspec.planners.replan.ReplanPolicy`; between plans,
:meth:`KnapsackPlanner.plan` returns the current plan at no cost.

Size: over 450 lines because the search's steps (each a short method) share the planner's
state (policy, copy gate, config) and one ``_SearchSetup`` record; the generic parts are
elsewhere (the DP in :mod:`~knapspec.planners.dp`, TPT in
:mod:`~knapspec.planners.objective`, re-planning in :mod:`~knapspec.planners.replan`,
lookup pricing in :mod:`~knapspec.planners.lookup`, the config record in
:mod:`~knapspec.planners.knapsack_config`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from knapspec.drafters.base import SUBNETWORK
from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.copying import CopyTracker
from knapspec.planners.dp import (
    HiddenStateDPResult,
    additive_knapsack,
    half_budget,
    hidden_state_dp,
    layer_groups,
    mean_cosine,
    single_items,
)
from knapspec.planners.knapsack_config import KnapsackPlannerConfig
from knapspec.planners.lookup import LookupOption, LookupPricing, lookup_plan
from knapspec.planners.objective import (
    GridSearchResult,
    RoundCosts,
    breakeven_acceptance,
    grid_search,
    tokens_per_time,
)
from knapspec.planners.replan import ReplanPolicy, ReplanReason
from knapspec.types import DraftPlan, StepOutcome, SublayerMask

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel

BoolArray = np.ndarray[Any, np.dtype[np.bool_]]
FloatArray = np.ndarray[Any, np.dtype[np.float64]]


@attrs.frozen
class KnapsackSearch:
    """What one full plan computed (kept as ``KnapsackPlanner.last_search_`` for reports).

    Attributes:
        plan: the plan returned.
        context_length: ``n`` at planning time.
        weights: ``(w_attn, w_mlp)`` from the cost model (``(1, 1)`` under TPL), from the
            layer-mean times (with sliding-window layers ``dp_weights`` tells them apart).
        dp_weights: the DP item weights actually used (after tying and the common divisor).
        max_budget: the skipped-weight bound.
        shortcut: True when the α = 1 bound proved γ = 0 optimal and no DP ran.
        dp: the DP result (None with the shortcut or a degenerate setting).
        candidates: DP candidate indices whose α was estimated.
        alphas: their estimated acceptance.
        grid: the grid search over them (None when it did not run).
        seconds: wall time of the whole plan.
        breakeven_acceptance: for a speculative plan, the α below which it is slower than
            plain steps under the same costs (None otherwise).
    """

    plan: DraftPlan
    context_length: int
    weights: tuple[int, int]
    dp_weights: tuple[int, ...]
    max_budget: int
    shortcut: bool
    dp: HiddenStateDPResult | None
    candidates: tuple[int, ...]
    alphas: tuple[float, ...]
    grid: GridSearchResult | None
    seconds: float
    breakeven_acceptance: float | None = None


@attrs.frozen
class _SearchSetup:
    """What every step of one search shares (step 1's output).

    Attributes:
        num_layers: the model's depth.
        context_length: ``n`` at planning time.
        cost_model: the decoder's cost model (None under TPL without one).
        prices_time: the TPT objective with a cost model (else layers are counted).
        max_draft: the largest γ this search may choose.
        weights: ``(w_attn, w_mlp)`` (``(1, 1)`` when not pricing time).
        groups: the engine items of each DP item.
        dp_weights: the DP item weights after tying and the common divisor.
        max_budget: the skipped-weight bound.
    """

    num_layers: int
    context_length: int
    cost_model: CostModel | None
    prices_time: bool
    max_draft: int
    weights: tuple[int, int]
    groups: tuple[tuple[int, ...], ...]
    dp_weights: tuple[int, ...]
    max_budget: int

    def result(
        self,
        plan: DraftPlan,
        *,
        shortcut: bool,
        dp: HiddenStateDPResult | None = None,
        candidates: tuple[int, ...] = (),
        alphas: tuple[float, ...] = (),
        grid: GridSearchResult | None = None,
        breakeven_acceptance: float | None = None,
    ) -> KnapsackSearch:
        """The search record of ``plan`` under this setup."""
        return KnapsackSearch(
            plan=plan,
            context_length=self.context_length,
            weights=self.weights,
            dp_weights=self.dp_weights,
            max_budget=self.max_budget,
            shortcut=shortcut,
            dp=dp,
            candidates=candidates,
            alphas=alphas,
            grid=grid,
            seconds=0.0,
            breakeven_acceptance=breakeven_acceptance,
        )

    def no_speculation(
        self, *, shortcut: bool, dp: HiddenStateDPResult | None = None
    ) -> KnapsackSearch:
        """The γ = 0 result (plain steps), with the cost model's speed when it has one."""
        speed = (
            1.0 / self.cost_model.step_cost(self.context_length)
            if self.cost_model is not None
            else None
        )
        plan = DraftPlan(
            SublayerMask.full(self.num_layers),
            0,
            predicted_tokens_per_second=speed,
            source="knapsack",
        )
        return self.result(plan, shortcut=shortcut, dp=dp)


@PLANNERS.register("knapsack")
class KnapsackPlanner(Planner):
    """KnapSpec: knapsack DP over attention/MLP items, TPT grid search over drafts × γ.

    Needs ``context.cost_model`` under the TPT objective (a :class:`ValueError` names the
    fix otherwise). Without ``context.proxy``, α is the top-1 agreement of each candidate's
    final state with the full model's greedy tokens on the DP window (the reference code's
    estimate), and the DP scores by mean cosine.

    Args:
        config: hyper-parameters; defaults are the paper's (τ = 0.5, half budget) plus
            CPU-sized bounds on the DP batch.
    """

    config_class = KnapsackPlannerConfig

    def __init__(self, config: KnapsackPlannerConfig | None = None) -> None:
        self.config: KnapsackPlannerConfig = self.checked_config(config)
        self.policy = ReplanPolicy(self.config.replan_config())
        self.last_search_: KnapsackSearch | None = None
        self.last_reason_: ReplanReason | None = None
        self.gated_rounds_ = 0
        self._copying = CopyTracker(self.config.copy_ngram, self.config.copy_recent_tokens)
        #: Per proposing drafter the config names, its own pricing (acceptance estimates).
        self._pricing = {
            name: LookupPricing(self.config.lookup_acceptance_config()) for name in self._proposers
        }
        self.last_lookup_: LookupOption | None = None

    # ------------------------------------------------------------- Planner API
    def reset(self) -> None:
        self.policy.reset()
        self.last_reason_ = None
        self.gated_rounds_ = 0
        self._copying.reset()
        for pricing in self._pricing.values():
            pricing.reset()
        self.last_lookup_ = None

    @property
    def _proposers(self) -> tuple[str, ...]:
        """The drafters priced by their proposals: every one the config names but the
        sub-network (the DP's own), under the TPT objective."""
        if self.config.objective != "tpt":
            return ()
        return tuple(name for name in self.config.drafters if name != SUBNETWORK)

    def proposal_drafters(self) -> frozenset[str]:
        return frozenset(self._proposers)

    def plan_drafters(self) -> frozenset[str]:
        subnetwork = {SUBNETWORK} if SUBNETWORK in self.config.drafters else set()
        return self.proposal_drafters() | subnetwork

    def update(self, outcome: StepOutcome) -> None:
        for name, pricing in self._pricing.items():
            pricing.observe(outcome, name)
        # The re-planning policy follows the sub-network plan (and plain steps) only.
        if outcome.plan.drafter_used not in self._pricing:
            self.policy.observe(outcome)

    def wants_window(self, tokens: torch.Tensor) -> bool:
        """Record the window only for a search that is due: while a speculative plan runs
        (a re-plan may follow any round), or when the re-planning policy would search at
        the next round's context length and the copy gate is open. The search then runs
        one round later, on a fresh window; every other round skips the recording (about
        1 % of a step on SmolLM2-135M)."""
        if SUBNETWORK not in self.config.drafters:
            return False
        current = self.policy.plan_
        if current is not None and current.draft_length > 0:
            return True
        # After this pass, the cache holds at least every token in ``tokens``.
        if self.policy.decide(tokens.numel(), has_window=True) is None:
            return False
        if self.config.search_gate == "always":
            return True
        return self._copying.update(tokens) >= self.config.min_copied_fraction

    def plan(self, context: PlanningContext) -> DraftPlan:
        """The best of: the sub-network plan (re-planned when the policy says so), this
        round's lookup proposal cut at its TPT optimum, and γ = 0."""
        if SUBNETWORK in self.config.drafters:
            subnetwork = self._plan_subnetwork(context)
        else:
            subnetwork = DraftPlan.autoregressive(context.engine.num_layers, source="knapsack")
        if not self._pricing or context.cost_model is None:
            return subnetwork
        return self._with_proposals(context, context.cost_model, subnetwork)

    def _with_proposals(
        self, context: PlanningContext, cost_model: CostModel, subnetwork: DraftPlan
    ) -> DraftPlan:
        """One TPT comparison of the best cut of this round's proposals (lookup's, any
        proposing drafter's) with ``subnetwork``."""
        max_draft = context.max_draft_length
        if self.config.max_draft_length is not None:
            max_draft = min(max_draft, self.config.max_draft_length)
        option, drafter = None, ""
        for name, pricing in self._pricing.items():
            priced = pricing.price(context, cost_model, max_draft, name)
            if priced is not None and (option is None or priced.beats(option)):
                option, drafter = priced, name
        self.last_lookup_ = option
        if option is None:
            return subnetwork
        n = context.context_length
        rival = option.plain_tokens_per_second * self.config.lookup_min_speedup
        if subnetwork.draft_length > 0 and subnetwork.predicted_acceptance is not None:
            gamma = subnetwork.draft_length
            rival = max(
                rival,
                tokens_per_time(
                    subnetwork.predicted_acceptance,
                    gamma,
                    cost_model.draft_cost(subnetwork.mask, n),
                    cost_model.verify_cost(gamma + 1, n),
                ),
            )
        if option.draft_length > 0 and option.tokens_per_second >= rival:
            return lookup_plan(
                context.engine.num_layers,
                option.draft_length,
                "knapsack",
                drafter=drafter,
                predicted_acceptance=option.mean_acceptance,
                predicted_tokens_per_second=option.tokens_per_second,
                tree_nodes=option.tree_nodes,
            )
        if subnetwork.draft_length == 0:
            return attrs.evolve(
                subnetwork,
                best_draft_speedup=option.best_draft_tokens_per_second
                / option.plain_tokens_per_second,
            )
        return subnetwork

    def _plan_subnetwork(self, context: PlanningContext) -> DraftPlan:
        """The layer-skip family: the current plan, or a new search when it is due."""
        current = self.policy.plan_
        if current is not None and current.mask.num_items != context.engine.num_items:
            self.policy.reset()  # a plan for another model: start over
            current = None
        reason = self.policy.decide(context.context_length, context.has_window)
        if reason is not None and not self._search_worthwhile(context):
            # No sign that drafts would be accepted: keep the current plan, look again next
            # round (the gate reads token ids only, it is free).
            self.gated_rounds_ += 1
            reason = None
        self.last_reason_ = reason
        if reason is None:
            if current is None:
                return DraftPlan.autoregressive(context.engine.num_layers, source="knapsack")
            if self.policy.acceptance_fell():
                # The plan is losing, and the time budget forbids a new search yet: fall
                # back to plain steps (always safe) until the policy allows re-planning.
                current = DraftPlan.autoregressive(context.engine.num_layers, source="knapsack")
                self.policy.abandon_plan(current)
            return current
        started = time.perf_counter()
        search = self.search(context)
        seconds = time.perf_counter() - started
        self.last_search_ = attrs.evolve(search, seconds=seconds)
        step = (
            context.cost_model.step_cost(context.context_length)
            if context.cost_model is not None
            else None
        )
        self.policy.record_plan(
            search.plan, context.context_length, seconds, search.breakeven_acceptance, step
        )
        return search.plan

    @property
    def planning_seconds(self) -> float:
        """Total time spent in full plans since the last :meth:`reset`."""
        return self.policy.planning_seconds_

    @property
    def plans_made(self) -> int:
        return self.policy.plans_made_

    # ------------------------------------------------------------- the search
    def search(self, context: PlanningContext) -> KnapsackSearch:
        """One full plan, ignoring the re-planning policy (benchmarks call this directly).

        The steps of the module docstring, each a method: :meth:`_setup` (weights and the
        budget), the provable shortcut, the affordability check, :meth:`_run_dp`,
        :meth:`_filter_candidates` and :meth:`_choose_plan`. The cache is only read.

        Raises:
            ValueError: the TPT objective has no cost model, or the context has no
                reference window.
        """
        setup = self._setup(context)
        if not self._could_speculate(setup):
            return setup.no_speculation(shortcut=True)
        assert context.window is not None  # checked by _setup
        tokens = self._dp_window_tokens(setup, context.window.size)
        if (
            setup.prices_time
            and self.config.allow_no_speculation
            and setup.cost_model is not None
            and not self._search_affordable(
                context, setup.cost_model, (setup.max_budget + 1) * tokens
            )
        ):
            return setup.no_speculation(shortcut=False)
        dp = self._run_dp(context, setup, tokens)
        if dp.num_candidates == 0:
            return setup.no_speculation(shortcut=False, dp=dp)
        costs = self._round_costs(setup, dp)
        candidates = self._filter_candidates(dp, costs)
        if not candidates:
            return setup.no_speculation(shortcut=False, dp=dp)
        alphas = self._acceptance(context, dp, candidates)
        return self._choose_plan(setup, dp, costs, candidates, alphas)

    def _setup(self, context: PlanningContext) -> _SearchSetup:
        """Step 1: the item weights at this context length and the skipped-weight bound."""
        config = self.config
        engine = context.engine
        n = context.context_length
        if context.window is None:
            raise ValueError("KnapsackPlanner.search needs a reference window (none committed yet)")
        cost_model = context.cost_model
        if config.objective == "tpt" and cost_model is None:
            raise ValueError(
                "KnapsackPlanner with objective='tpt' needs a cost model: pass cost_model= to "
                "the decoder (e.g. a fitted or online one) or use objective='tpl'"
            )
        max_draft = context.max_draft_length
        if config.max_draft_length is not None:
            max_draft = min(max_draft, config.max_draft_length)
        prices_time = config.objective == "tpt" and cost_model is not None
        weights = cost_model.weights(n) if (cost_model is not None and prices_time) else (1, 1)
        item_weights = (
            cost_model.item_weights(n, engine.windows)
            if (cost_model is not None and prices_time)
            else (1, 1) * engine.num_layers
        )
        groups = (
            single_items(engine.num_items) if config.decoupled else layer_groups(engine.num_layers)
        )
        dp_weights = _reduced_weights(groups, item_weights)
        max_budget = half_budget(dp_weights, config.budget_fraction)
        if config.max_budget is not None:
            max_budget = min(max_budget, config.max_budget)
        return _SearchSetup(
            num_layers=engine.num_layers,
            context_length=n,
            cost_model=cost_model,
            prices_time=prices_time,
            max_draft=max_draft,
            weights=weights,
            groups=groups,
            dp_weights=dp_weights,
            max_budget=max_budget,
        )

    def _could_speculate(self, setup: _SearchSetup) -> bool:
        """Step 2, the provable shortcut: False when no draft within the budget can beat a
        plain step even at α = 1 (or there is no room to draft at all)."""
        if setup.max_draft == 0 or setup.max_budget == 0:
            return False
        if not (setup.prices_time and self.config.allow_no_speculation):
            return True
        assert setup.cost_model is not None  # prices_time
        return _can_beat_autoregressive(
            setup.cost_model,
            setup.groups,
            setup.dp_weights,
            setup.max_budget,
            setup.context_length,
            setup.max_draft,
        )

    def _dp_window_tokens(self, setup: _SearchSetup, window_size: int) -> int:
        """Window tokens the DP uses: the configured cap, shortened so that live budgets ×
        tokens stays within ``max_batch_rows`` (at least one token)."""
        tokens = min(self.config.max_window_tokens, window_size)
        if self.config.max_batch_rows is not None:
            tokens = max(1, min(tokens, self.config.max_batch_rows // (setup.max_budget + 1)))
        return tokens

    def _run_dp(
        self, context: PlanningContext, setup: _SearchSetup, tokens: int
    ) -> HiddenStateDPResult:
        """Step 3: the hidden-state DP, one candidate mask per reachable skipped weight."""
        assert context.window is not None  # checked by _setup
        tau = self.config.tau
        if context.proxy is not None and tau is not None:
            low, high = context.proxy.score_range
            if not low <= tau <= high:
                raise ValueError(
                    f"KnapsackPlanner tau={tau} lies outside the proxy's score range "
                    f"[{low}, {high}], so the DP would prune every draft; set tau inside "
                    "it or to None"
                )
        score_fn = context.proxy.score if context.proxy is not None else mean_cosine
        return hidden_state_dp(
            context.engine,
            context.window,
            context.cache,
            setup.dp_weights,
            max_budget=setup.max_budget,
            groups=setup.groups,
            min_score=self.config.tau,
            score_fn=score_fn,
            max_window_tokens=tokens,
        )

    def _round_costs(self, setup: _SearchSetup, dp: HiddenStateDPResult) -> RoundCosts:
        """Per candidate the draft cost, per γ the verify cost, plus amortised planning."""
        planning = self.policy.amortised_planning_seconds if self.config.amortise_planning else 0.0
        if setup.prices_time and setup.cost_model is not None:
            return RoundCosts.from_cost_model(
                setup.cost_model, dp.masks, setup.context_length, setup.max_draft, planning
            )
        return RoundCosts.layer_counting(dp.masks, setup.max_draft)

    def _filter_candidates(self, dp: HiddenStateDPResult, costs: RoundCosts) -> tuple[int, ...]:
        """Step 4: the DP candidates worth an α estimate (indices into ``dp.masks``)."""
        # A draft that skips nothing is the target itself: it costs a full step per token,
        # so it can never beat plain decoding whatever a miscalibrated cost model says.
        keep = np.array([mask.num_skipped > 0 for mask in dp.masks], dtype=bool)
        if self.config.allow_no_speculation:
            keep &= _can_pay_at_perfect_acceptance(costs)
        if self.config.pareto_candidates:
            keep &= _pareto_front(dp.scores.double().cpu().numpy(), costs.draft)
        return tuple(int(i) for i in np.flatnonzero(keep))

    def _choose_plan(
        self,
        setup: _SearchSetup,
        dp: HiddenStateDPResult,
        costs: RoundCosts,
        candidates: tuple[int, ...],
        alphas: list[float],
    ) -> KnapsackSearch:
        """Step 5: the grid search over candidates × γ, then the margin a speculative plan
        must clear (``min_predicted_speedup``)."""
        config = self.config
        subset = RoundCosts(
            draft=costs.draft[list(candidates)], verify=costs.verify, planning=costs.planning
        )
        grid = grid_search(alphas, subset, allow_no_speculation=config.allow_no_speculation)
        if (
            setup.prices_time
            and config.allow_no_speculation
            and grid.draft_length > 0
            and grid.objective * float(costs.verify[0]) < config.min_predicted_speedup
        ):
            grid = attrs.evolve(grid, candidate=0, draft_length=0)
        if grid.draft_length == 0:
            result = setup.no_speculation(shortcut=False, dp=dp)
            return attrs.evolve(result, candidates=candidates, alphas=tuple(alphas), grid=grid)
        mask = dp.masks[candidates[grid.candidate]]
        breakeven = None
        if setup.prices_time:
            breakeven = breakeven_acceptance(
                grid.draft_length,
                float(subset.draft[grid.candidate]),
                float(costs.verify[grid.draft_length]),
                float(costs.verify[0]),
                costs.planning,
            )
        plan = DraftPlan(
            mask,
            grid.draft_length,
            predicted_acceptance=float(alphas[grid.candidate]),
            predicted_tokens_per_second=self._predicted_speed(setup, grid, mask),
            source="knapsack",
        )
        return setup.result(
            plan,
            shortcut=False,
            dp=dp,
            candidates=candidates,
            alphas=tuple(alphas),
            grid=grid,
            breakeven_acceptance=breakeven,
        )

    @staticmethod
    def _predicted_speed(
        setup: _SearchSetup, grid: GridSearchResult, mask: SublayerMask
    ) -> float | None:
        """Tokens per second of the chosen plan: the TPT objective itself, or under TPL the
        cost model's price of the chosen round (None without a cost model)."""
        if setup.prices_time:
            return grid.objective
        cost_model, n = setup.cost_model, setup.context_length
        if cost_model is None:
            return None
        spend = grid.draft_length * cost_model.draft_cost(mask, n)
        return grid.expected_tokens / (spend + cost_model.verify_cost(grid.draft_length + 1, n))

    def _search_worthwhile(self, context: PlanningContext) -> bool:
        """The search gate: True unless ``search_gate="copy"`` and the recent output is not
        copied from the context (always True when the context carries no token ids)."""
        config = self.config
        if config.search_gate == "always" or context.tokens is None:
            return True
        return self._copying.update(context.tokens) >= config.min_copied_fraction

    def _search_affordable(
        self, context: PlanningContext, cost_model: CostModel, rows: int
    ) -> bool:
        """Whether one DP fits the planning budget of what is left of this generation.

        One DP pass runs every item once over ``rows`` rows (live budgets × window
        tokens) attending to the context, which costs about a full forward over ``rows``
        tokens: ``verify_cost(rows, n)``. It is allowed when that is at most
        ``max_planning_fraction`` of the remaining generation time at plain-decoding speed,
        so a short generation at long context never pays for a search it cannot recoup.
        """
        fraction = self.config.max_planning_fraction
        if fraction is None or context.remaining_tokens is None:
            return True
        n = context.context_length
        predicted = cost_model.verify_cost(rows, n)
        remaining = context.remaining_tokens * cost_model.step_cost(n)
        return predicted <= fraction * remaining

    def _acceptance(
        self, context: PlanningContext, dp: HiddenStateDPResult, candidates: tuple[int, ...]
    ) -> list[float]:
        """α of each candidate: from the proxy (batched), or top-1 agreement without one."""
        states = dp.final_states[list(candidates)]
        if context.proxy is not None:
            estimates = context.proxy.estimate_acceptance(
                context.engine, dp.window, states, context.sampling
            )
            if len(estimates) != len(candidates):
                raise RuntimeError(
                    f"proxy returned {len(estimates)} estimates for {len(candidates)} candidates"
                )
            raw = [float(e.alpha) for e in estimates]
        else:
            with torch.inference_mode():
                predicted = context.engine.logits(states).argmax(dim=-1)  # (K, r)
            target = dp.window.target_tokens.to(predicted.device)
            raw = [float(x) for x in (predicted == target).float().mean(dim=-1).tolist()]
        tokens, counts = float(dp.window.size), self.config.acceptance_pseudo_counts
        return [(tokens * alpha + counts / 2) / (tokens + counts) for alpha in raw]


# ---------------------------------------------------------------------------- helpers
def _reduced_weights(
    groups: tuple[tuple[int, ...], ...], item_weights: tuple[int, ...]
) -> tuple[int, ...]:
    """Per DP item, the summed weights of its engine items (``item_weights``, one per
    engine item), divided by their common divisor.

    Dividing by the gcd leaves the set of feasible skip sets per budget unchanged and
    shrinks the number of budgets (e.g. tied layers of weight 4 become weight 1).
    """
    raw = [sum(item_weights[item] for item in group) for group in groups]
    divisor = math.gcd(*raw) or 1
    return tuple(w // divisor for w in raw)


def _item_times(cost_model: CostModel, groups: tuple[tuple[int, ...], ...], n: int) -> list[float]:
    """Predicted seconds of each DP item (the sum of its engine items' times)."""
    return [
        sum(
            cost_model.t_attn(n, item // 2) if item % 2 == 0 else cost_model.t_mlp(item // 2)
            for item in group
        )
        for group in groups
    ]


def _can_beat_autoregressive(
    cost_model: CostModel,
    groups: tuple[tuple[int, ...], ...],
    dp_weights: tuple[int, ...],
    max_budget: int,
    n: int,
    max_draft: int,
) -> bool:
    """Whether *some* draft within the budget could beat a plain step, even at α = 1.

    The cheapest draft per exact budget comes from an additive knapsack over item times
    (maximise the executed items' negative time). If the grid search prefers γ = 0 even
    with those costs and perfect acceptance, no candidate of the hidden-state DP can win:
    its drafts cost at least as much and accept at most as often. Uses the cost model's
    per-item times and overhead (the base ``draft_cost`` formula).
    """
    times = _item_times(cost_model, groups, n)
    cheapest = additive_knapsack(dp_weights, [-t for t in times], max_budget)
    draft = cost_model.overhead(n) - cheapest.scores.numpy()
    verify = np.array(
        [cost_model.step_cost(n)]
        + [cost_model.verify_cost(k + 1, n) for k in range(1, max_draft + 1)]
    )
    best = grid_search(np.ones(draft.size), RoundCosts(draft=np.maximum(draft, 0.0), verify=verify))
    return best.speculates


def _can_pay_at_perfect_acceptance(costs: RoundCosts) -> BoolArray:
    """Per candidate: does any γ ≥ 1 beat a plain step when α = 1? (a provable filter)."""
    gamma = np.arange(1, costs.verify.size)
    best = (
        (gamma + 1)[None, :]
        / (gamma[None, :] * costs.draft[:, None] + costs.verify[None, 1:] + costs.planning)
    ).max(axis=1)
    result: BoolArray = best > 1.0 / costs.verify[0]
    return result


def _pareto_front(scores: FloatArray, draft_costs: FloatArray) -> BoolArray:
    """Candidates not dominated: no other has a score >= and a cost <=, one of them strictly."""
    better_or_equal = (scores[None, :] >= scores[:, None]) & (
        draft_costs[None, :] <= draft_costs[:, None]
    )
    strictly = (scores[None, :] > scores[:, None]) | (draft_costs[None, :] < draft_costs[:, None])
    dominated: BoolArray = np.asarray((better_or_equal & strictly).any(axis=1), dtype=bool)
    return ~dominated


__all__ = ["KnapsackPlanner", "KnapsackPlannerConfig", "KnapsackSearch"]
