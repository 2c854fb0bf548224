"""The knapsack planner's hyper-parameters: :class:`KnapsackPlannerConfig`.

Kept apart from :mod:`~knapspec.planners.knapsack` (the search) because the record has its
own reasons to change: it gathers settings that other modules define and validate (the
re-planning policy's, :class:`~knapspec.planners.replan.ReplanConfig`, and the lookup
acceptance estimates', :class:`~knapspec.drafters.acceptance.LookupAcceptanceConfig`),
reusing their defaults and validators so that a config file is checked when it is loaded.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from knapspec.drafters.acceptance import LookupAcceptanceConfig, check_priors_match_buckets
from knapspec.drafters.base import LOOKUP, SUBNETWORK
from knapspec.planners.replan import ReplanConfig
from knapspec.validators import at_least, cosine, interval, optional, unit_interval

Objective = Literal["tpt", "tpl"]
SearchGate = Literal["always", "copy"]


_REPLAN_FIELDS = attrs.fields_dict(ReplanConfig)


def _replan_field(name: str) -> Any:
    """The re-planning setting ``name``, with :class:`ReplanConfig`'s default and validator."""
    field = _REPLAN_FIELDS[name]
    return attrs.field(default=field.default, validator=field.validator)


_ACCEPTANCE_FIELDS = attrs.fields_dict(LookupAcceptanceConfig)


def _acceptance_field(name: str) -> Any:
    """The lookup acceptance setting ``name`` (``lookup_`` + a
    :class:`LookupAcceptanceConfig` field), with its default, converter and validator."""
    field = _ACCEPTANCE_FIELDS[name]
    return attrs.field(default=field.default, converter=field.converter, validator=field.validator)


#: The drafter families the knapsack planner searches by default: its own sub-network
#: and prompt lookup (any other registered drafter that proposes before planning may be
#: named too; the decoder checks it when it builds it).
DRAFTER_FAMILIES = (SUBNETWORK, LOOKUP)


def _drafter_names(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    bad = [name for name in value if not isinstance(name, str) or not name]
    if bad:
        raise ValueError(f"{attribute.name} must name drafters (non-empty strings); got {bad}")
    if len(set(value)) != len(value):
        raise ValueError(f"{attribute.name} names a drafter twice: {list(value)}")


@attrs.frozen
class KnapsackPlannerConfig:
    """Hyper-parameters of :class:`KnapsackPlanner`.

    Attributes:
        drafters: the drafter families searched each round besides γ = 0: ``"subnetwork"``
            (the knapsack DP's layer-skip draft, searched when the copy gate and planning
            budget allow) and ``"lookup"`` (the round's prompt-lookup proposal, priced every
            round and cut at its TPT-optimal length), or any other registered drafter that
            proposes before planning (priced as lookup is, with its own acceptance
            estimates). Drop one for the ablation; an empty tuple is plain decoding.
        lookup_min_speedup: a lookup draft is taken only when its predicted TPT is at least
            this times a plain step's (and at least the sub-network plan's).
        lookup_match_edges: lower edges of the match-length buckets of the online lookup
            acceptance estimates (integers rising strictly from 1; ``[1, 2, 4]``: 1, 2-3
            and 4+ matched tokens); see
            :class:`~knapspec.drafters.acceptance.LookupAcceptanceConfig`.
        lookup_prior_acceptance: per bucket, the prior per-token acceptance of a lookup
            draft, each in (0, 1) (one value per edge of ``lookup_match_edges``).
        lookup_prior_strength: pseudo-trials of the prior in a bucket's pooled rate (> 0).
        lookup_position_strength: pseudo-trials of the pooled rate in each draft
            position's rate (> 0).
        lookup_decay: every observed round multiplies the acceptance counts by this, in
            (0, 1] (1 = never forget).
        lookup_max_positions: draft positions whose acceptance is tracked separately (>= 1).
        tau: DP pruning threshold τ on the value (cosine); None disables pruning.
        budget_fraction: the half-budget bound — skip at most this fraction of the weight.
        max_budget: an absolute cap on the skipped weight (None: only the fraction). The
            default 12 bounds the DP's batch: on small models acceptance collapses long
            before half the weight is skipped (SmolLM2: α ≈ 0.5-0.7 at 10 items; the
            oracle's best masks skip 6-8 items).
        max_window_tokens: the DP uses at most the last this-many window tokens.
        max_batch_rows: bound on ``live budgets × window tokens`` per batched item call; the
            window is shortened (down to one token) to respect it. None: no bound. One DP
            costs about a full forward over this many tokens; 32 (13 budgets × 2 tokens
            with the default ``max_budget``) keeps it near 4-5 decode steps on a CPU, so it
            fits the planning budget of a 128-token answer.
        decoupled: attention and MLP are separate items (KnapSpec); False ties each layer
            into one item (the ablation, CLaSp-like structure with KnapSpec's costs).
        objective: ``"tpt"`` (tokens per second, needs a cost model) or ``"tpl"`` (DEL's
            tokens-per-layer, for the ablation).
        allow_no_speculation: γ = 0 may win (off only for the ablation).
        pareto_candidates: estimate α only for candidates not dominated in (score, cost).
        max_draft_length: cap on γ below the decoder's D (None: D).
        amortise_planning: charge the amortised planning time to speculative rounds in TPT.
        min_predicted_speedup: a speculative plan must be predicted at least this much
            faster than plain steps (TPT ratio); below it γ = 0 is kept. The margin covers
            the cost model's and the proxy's error: a predicted 1.02x is a coin flip.
        acceptance_pseudo_counts: α estimated on ``r`` window tokens is shrunk to
            ``(r·α̂ + c/2) / (r + c)`` (c = 2: Laplace's rule of succession, a uniform
            prior). The DP's window is only a few tokens on a CPU, and α̂ = 1 on 2 tokens
            is weak evidence; 0 uses the raw estimate.
        search_gate: ``"copy"`` runs a search only while the recent output is copied from
            the context (:class:`~knapspec.planners.copying.CopyTracker` at least
            ``min_copied_fraction``), the regime where layer-skipping drafts are accepted
            often enough to pay on a CPU; elsewhere plain steps cost nothing to keep.
            ``"always"`` searches whenever the re-planning policy triggers (the ablation).
        copy_ngram, copy_recent_tokens, min_copied_fraction: the gate's n-gram length,
            scored tokens and threshold. At 0.5, summaries of a passage (which quote its
            names and phrases) opened the gate for a search that found γ = 0 and cost 2 % of
            the answer; verbatim copying scores 1.0.
        context_growth, acceptance_drift, drift_min_rounds, acceptance_smoothing,
        every_rounds, max_planning_fraction, prior_trials, max_backoff: the re-planning policy
            (:class:`~knapspec.planners.replan.ReplanConfig`).
    """

    drafters: tuple[str, ...] = attrs.field(
        default=DRAFTER_FAMILIES, converter=tuple, validator=_drafter_names
    )
    lookup_min_speedup: float = attrs.field(default=1.0, validator=interval(1.0, math.inf))
    lookup_match_edges: tuple[int, ...] = _acceptance_field("match_edges")
    lookup_prior_acceptance: tuple[float, ...] = _acceptance_field("prior_acceptance")
    lookup_prior_strength: float = _acceptance_field("prior_strength")
    lookup_position_strength: float = _acceptance_field("position_strength")
    lookup_decay: float = _acceptance_field("decay")
    lookup_max_positions: int = _acceptance_field("max_positions")
    tau: float | None = attrs.field(default=0.5, validator=optional(cosine))
    budget_fraction: float = attrs.field(default=0.5, validator=unit_interval)
    max_budget: int | None = attrs.field(default=12, validator=optional(at_least(0)))
    max_window_tokens: int = attrs.field(default=4, validator=at_least(1))
    max_batch_rows: int | None = attrs.field(default=32, validator=optional(at_least(1)))
    decoupled: bool = True
    objective: Objective = attrs.field(
        default="tpt", validator=attrs.validators.in_(("tpt", "tpl"))
    )
    allow_no_speculation: bool = True
    pareto_candidates: bool = True
    max_draft_length: int | None = attrs.field(default=None, validator=optional(at_least(0)))
    amortise_planning: bool = True
    min_predicted_speedup: float = attrs.field(default=1.05, validator=attrs.validators.ge(1.0))
    acceptance_pseudo_counts: float = attrs.field(default=2.0, validator=attrs.validators.ge(0.0))
    search_gate: SearchGate = attrs.field(
        default="copy", validator=attrs.validators.in_(("always", "copy"))
    )
    copy_ngram: int = attrs.field(default=3, validator=at_least(1))
    copy_recent_tokens: int = attrs.field(default=16, validator=at_least(1))
    min_copied_fraction: float = attrs.field(default=0.75, validator=unit_interval)
    # The re-planning settings: ReplanConfig's defaults and validators, so a file is
    # checked when it is loaded, not when the planner is built.
    context_growth: float | None = _replan_field("context_growth")
    acceptance_drift: float | None = _replan_field("acceptance_drift")
    drift_min_rounds: int = _replan_field("drift_min_rounds")
    acceptance_smoothing: float = _replan_field("acceptance_smoothing")
    every_rounds: int | None = _replan_field("every_rounds")
    max_planning_fraction: float | None = _replan_field("max_planning_fraction")
    prior_trials: float = _replan_field("prior_trials")
    max_backoff: int = _replan_field("max_backoff")

    def __attrs_post_init__(self) -> None:
        check_priors_match_buckets(
            self.lookup_match_edges,
            self.lookup_prior_acceptance,
            "lookup_match_edges",
            "lookup_prior_acceptance",
        )

    def lookup_acceptance_config(self) -> LookupAcceptanceConfig:
        """The ``lookup_*`` acceptance fields as a :class:`LookupAcceptanceConfig`."""
        return LookupAcceptanceConfig(
            **{name: getattr(self, f"lookup_{name}") for name in _ACCEPTANCE_FIELDS}
        )

    def replan_config(self) -> ReplanConfig:
        """The re-planning fields as a :class:`ReplanConfig`."""
        return ReplanConfig(**{name: getattr(self, name) for name in _REPLAN_FIELDS})


__all__ = ["DRAFTER_FAMILIES", "KnapsackPlannerConfig", "Objective", "SearchGate"]
