"""When to re-plan: a policy that keeps planning's share of generation time small.

Re-planning triggers (each configurable, any may be switched off):

* **no plan** yet while a reference window exists (the first plan);
* **context growth**: the context grew by ``context_growth`` (a fraction) since the last
  plan — the best draft shifts from MLP to attention skips as the context grows;
* **acceptance drift**: the observed per-token acceptance (an EMA over rounds, from
  :class:`~knapspec.types.StepOutcome`) differs from the plan's prediction by more than
  ``acceptance_drift``;
* **periodic**: every ``every_rounds`` rounds — also while the plan is γ = 0, when there is
  no acceptance to observe, so that a turn to copy-heavy text is noticed.

A speculative plan is **abandoned** (replaced by plain steps until the next plan) as soon as
its acceptance is credibly below its *break-even* acceptance — the α at which the plan's
tokens-per-time equals a plain step's. The estimate is the posterior mean of a Beta prior
worth ``prior_trials`` trials at the predicted α, updated with the observed accepts and
trials; a rejected first round of a plan predicted at α = 0.83 with break-even 0.7 is
enough. Independently of any model, a plan is also abandoned when its *measured* speed over
its first ``drift_min_rounds`` speculative rounds or more (committed tokens per second of
draft + verify time) is below the measured speed of plain steps (or, before any was
measured, the cost model's): the wall clock has the last word.

Every search that ends at γ = 0 and every abandoned plan doubles the periodic
interval and the time budget's wait (**back-off**, up to ``max_backoff`` doublings), so that
on text where speculation does not pay the planner soon stops paying for searches; a plan
that survives its first ``drift_min_rounds`` rounds resets the back-off.

Every trigger except the first is held back by a **time budget**: a re-plan is allowed only
once the generation time since the last plan is large enough that the last plan's measured
time is at most ``max_planning_fraction`` of the total, ``t_plan / (t_plan + t_since) <= f``.
The amortised planning share therefore stays near ``f / 2^backoff`` whatever one DP costs.
"""

from __future__ import annotations

from enum import StrEnum

import attrs

from knapspec.types import DraftPlan, StepOutcome
from knapspec.validators import at_least, open_unit_interval, optional, positive


@attrs.frozen
class ReplanConfig:
    """Hyper-parameters of :class:`ReplanPolicy` (None switches a trigger off).

    Attributes:
        context_growth: re-plan when the context grew by this fraction since the last plan.
        acceptance_drift: re-plan when ``|observed α (EMA) - predicted α|`` exceeds this.
        drift_min_rounds: speculative rounds observed before drift may trigger.
        acceptance_smoothing: weight of the newest round in the acceptance EMA, in (0, 1).
        every_rounds: re-plan at least every this-many rounds (also under a γ = 0 plan).
        max_planning_fraction: the time budget ``f`` holding back every trigger but the
            first plan (the knapsack planner also skips any search predicted to cost more
            than ``f`` of the remaining generation). 0.02: a search that ends at γ = 0 —
            the usual outcome on a CPU — then costs KnapSpec at most 2 % against plain
            decoding; at 0.05 such searches cost 2-4 % of 128-token answers.
        prior_trials: weight, in trials, of the predicted α in the posterior that decides
            whether a plan fell below its break-even acceptance (0: observations only).
        max_backoff: most doublings of the periodic interval and the budget's wait after
            searches that did not pay (0: no back-off).
    """

    context_growth: float | None = attrs.field(default=0.25, validator=optional(positive))
    acceptance_drift: float | None = attrs.field(default=0.2, validator=optional(positive))
    drift_min_rounds: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    acceptance_smoothing: float = attrs.field(default=0.3, validator=open_unit_interval)
    every_rounds: int | None = attrs.field(default=32, validator=optional(at_least(1)))
    max_planning_fraction: float | None = attrs.field(
        default=0.02, validator=optional(open_unit_interval)
    )
    prior_trials: float = attrs.field(default=4.0, validator=attrs.validators.ge(0.0))
    max_backoff: int = attrs.field(default=3, validator=attrs.validators.ge(0))


class ReplanReason(StrEnum):
    """Why a re-plan was requested (kept in the planner's stats)."""

    INITIAL = "initial"
    CONTEXT_GROWTH = "context_growth"
    ACCEPTANCE_DRIFT = "acceptance_drift"
    PERIODIC = "periodic"


class ReplanPolicy:
    """Decides, before each round, whether the planner should plan again.

    The planner calls :meth:`decide` before planning, :meth:`record_plan` after each plan
    (with its measured time) and :meth:`observe` with every round's outcome.

    Args:
        config: the triggers and the time budget.
    """

    def __init__(self, config: ReplanConfig | None = None) -> None:
        self.config = config if config is not None else ReplanConfig()
        self.reset()

    def reset(self) -> None:
        """Forget the current plan and all observations (a new generation)."""
        self.plan_: DraftPlan | None = None
        self.planned_at_length_: int = 0
        self.last_plan_seconds_: float = 0.0
        self.rounds_since_plan_: int = 0
        self.seconds_since_plan_: float = 0.0
        self.speculative_rounds_: int = 0
        self.accepted_ema_: float | None = None
        self.trials_ema_: float | None = None
        self.plans_made_: int = 0
        self.planning_seconds_: float = 0.0
        self.breakeven_: float | None = None
        self.accepted_total_: int = 0
        self.trials_total_: int = 0
        self.backoff_: int = 0
        self.abandoned_: int = 0
        self.spec_tokens_: int = 0
        self.spec_seconds_: float = 0.0
        self.plain_step_seconds_: float | None = None
        self.measured_plain_: bool = False

    # ------------------------------------------------------------------ feedback
    def record_plan(
        self,
        plan: DraftPlan,
        context_length: int,
        seconds: float,
        breakeven_acceptance: float | None = None,
        plain_step_seconds: float | None = None,
    ) -> None:
        """A new plan was made at ``context_length``, taking ``seconds``.

        Args:
            breakeven_acceptance: the α below which the plan is slower than plain steps
                (None: unknown, only the drift rule can abandon it).
            plain_step_seconds: the cost model's plain step at ``context_length``, the
                reference speed until plain steps have been measured.
        """
        if plain_step_seconds is not None and not self.measured_plain_:
            self.plain_step_seconds_ = plain_step_seconds
        self.spec_tokens_, self.spec_seconds_ = 0, 0.0
        if plan.draft_length == 0:
            self._back_off()
        self.plan_ = plan
        self.breakeven_ = breakeven_acceptance if plan.draft_length > 0 else None
        self.accepted_total_ = self.trials_total_ = 0
        self.planned_at_length_ = context_length
        self.last_plan_seconds_ = max(0.0, seconds)
        self.rounds_since_plan_ = 0
        self.seconds_since_plan_ = 0.0
        self.speculative_rounds_ = 0
        self.accepted_ema_ = self.trials_ema_ = None
        self.plans_made_ += 1
        self.planning_seconds_ += max(0.0, seconds)

    def observe(self, outcome: StepOutcome) -> None:
        """One round's result: timings always, acceptance when tokens were drafted.

        Per-token acceptance is estimated as accepted / trials, where a round's trials are
        its accepted drafts plus one if a draft was rejected (the geometric-law estimate);
        both counts are smoothed by the same EMA.
        """
        self.rounds_since_plan_ += 1
        round_seconds = max(0.0, outcome.draft_time_s + outcome.verify_time_s)
        self.seconds_since_plan_ += round_seconds
        if outcome.drafted <= 0:
            if outcome.plan.draft_length == 0 and round_seconds > 0:
                # A plain step: the reference speed every speculative plan must beat.
                previous = self.plain_step_seconds_ if self.measured_plain_ else None
                self.plain_step_seconds_ = (
                    round_seconds
                    if previous is None
                    else previous + 0.2 * (round_seconds - previous)
                )
                self.measured_plain_ = True
            return
        self.spec_tokens_ += outcome.accepted + 1
        self.spec_seconds_ += round_seconds
        trials = outcome.accepted + (1 if outcome.accepted < outcome.drafted else 0)
        if trials == 0:
            return
        weight = self.config.acceptance_smoothing
        self.accepted_total_ += outcome.accepted
        self.trials_total_ += trials
        if self.accepted_ema_ is None or self.trials_ema_ is None:
            self.accepted_ema_, self.trials_ema_ = float(outcome.accepted), float(trials)
        else:
            self.accepted_ema_ += weight * (outcome.accepted - self.accepted_ema_)
            self.trials_ema_ += weight * (trials - self.trials_ema_)
        self.speculative_rounds_ += 1
        if (
            self.speculative_rounds_ == self.config.drift_min_rounds
            and not self.below_breakeven()
            and not self.slower_than_plain()
        ):
            self.backoff_ = 0  # the plan survived its trial: speculation pays here

    def _back_off(self) -> None:
        self.backoff_ = min(self.backoff_ + 1, self.config.max_backoff)

    @property
    def posterior_acceptance(self) -> float | None:
        """Posterior mean of the current plan's α: Beta prior worth ``prior_trials`` trials at
        the predicted α, updated with this plan's accepts and trials (None without a
        speculative plan)."""
        plan = self.plan_
        if plan is None or plan.draft_length == 0 or plan.predicted_acceptance is None:
            return None
        prior = self.config.prior_trials
        trials = prior + self.trials_total_
        if trials <= 0:
            return None
        return (prior * plan.predicted_acceptance + self.accepted_total_) / trials

    def slower_than_plain(self) -> bool:
        """Whether the current plan's measured tokens per second, over at least
        ``drift_min_rounds`` speculative rounds, is below plain decoding's."""
        plain = self.plain_step_seconds_
        return (
            plain is not None
            and self.plan_ is not None
            and self.plan_.draft_length > 0
            and self.speculative_rounds_ >= self.config.drift_min_rounds
            and self.spec_seconds_ > 0
            and self.spec_tokens_ / self.spec_seconds_ < 1.0 / plain
        )

    def below_breakeven(self) -> bool:
        """Whether the current plan's posterior α fell below its break-even α (after at
        least one speculative round)."""
        posterior = self.posterior_acceptance
        return (
            self.breakeven_ is not None
            and posterior is not None
            and self.speculative_rounds_ > 0
            and posterior < self.breakeven_
        )

    @property
    def observed_acceptance(self) -> float | None:
        """The smoothed per-token acceptance under the current plan (None before data)."""
        if self.accepted_ema_ is None or not self.trials_ema_:
            return None
        return self.accepted_ema_ / self.trials_ema_

    @property
    def amortised_planning_seconds(self) -> float:
        """Planning time charged to each speculative round by the TPT search.

        The last plan's time spread over the rounds the time budget makes it last at least
        (or over ``every_rounds`` when there is no budget).
        """
        rounds = self.expected_rounds_per_plan()
        return self.last_plan_seconds_ / rounds if rounds else 0.0

    def expected_rounds_per_plan(self) -> float:
        """Rounds one plan is expected to serve (for amortising its cost); 0 if unknown."""
        interval = self.periodic_interval()
        return float(interval) if interval is not None else 0.0

    def periodic_interval(self) -> int | None:
        """Rounds between periodic re-plans under the current back-off (None: never)."""
        every = self.config.every_rounds
        return None if every is None else every * (1 << self.backoff_)

    def acceptance_fell(self) -> bool:
        """Whether a speculative plan should be abandoned: its posterior α is below its
        break-even α, or its observed acceptance fell below the prediction by more than
        ``acceptance_drift`` (after ``drift_min_rounds`` rounds)."""
        config = self.config
        plan = self.plan_
        observed = self.observed_acceptance
        if self.below_breakeven() or self.slower_than_plain():
            return True
        return (
            config.acceptance_drift is not None
            and plan is not None
            and plan.draft_length > 0
            and plan.predicted_acceptance is not None
            and observed is not None
            and self.speculative_rounds_ >= config.drift_min_rounds
            and observed < plan.predicted_acceptance - config.acceptance_drift
        )

    def replace_plan(self, plan: DraftPlan) -> None:
        """Swap the current plan without counting a new plan (its timers keep running)."""
        self.plan_ = plan
        self.speculative_rounds_ = 0
        self.accepted_ema_ = self.trials_ema_ = None
        self.accepted_total_ = self.trials_total_ = 0
        self.spec_tokens_, self.spec_seconds_ = 0, 0.0
        self.breakeven_ = None

    def abandon_plan(self, fallback: DraftPlan) -> None:
        """The speculative plan lost: switch to ``fallback`` (plain steps) and back off."""
        self.abandoned_ += 1
        self._back_off()
        self.replace_plan(fallback)

    # ------------------------------------------------------------------ decision
    def within_budget(self) -> bool:
        """Whether enough generation time passed since the last plan to afford another."""
        fraction = self.config.max_planning_fraction
        if fraction is None:
            return True
        needed = self.last_plan_seconds_ * (1.0 - fraction) / fraction * (1 << self.backoff_)
        return self.seconds_since_plan_ >= needed

    def decide(self, context_length: int, has_window: bool) -> ReplanReason | None:
        """The reason to re-plan now, or None to keep the current plan."""
        if not has_window:
            return None
        if self.plan_ is None:
            return ReplanReason.INITIAL
        if not self.within_budget():
            return None
        config = self.config
        if config.context_growth is not None and context_length >= self.planned_at_length_ * (
            1.0 + config.context_growth
        ):
            return ReplanReason.CONTEXT_GROWTH
        predicted = self.plan_.predicted_acceptance
        observed = self.observed_acceptance
        if (
            config.acceptance_drift is not None
            and self.plan_.draft_length > 0
            and predicted is not None
            and observed is not None
            and self.speculative_rounds_ >= config.drift_min_rounds
            and abs(observed - predicted) > config.acceptance_drift
        ):
            return ReplanReason.ACCEPTANCE_DRIFT
        interval = self.periodic_interval()
        if interval is not None and self.rounds_since_plan_ >= interval:
            return ReplanReason.PERIODIC
        return None


__all__ = ["ReplanConfig", "ReplanPolicy", "ReplanReason"]
