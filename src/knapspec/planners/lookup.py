"""Pricing lookup drafts by tokens per time, and the fixed-length lookup baseline planner.

:class:`LookupPricing` is what the knapsack planner uses for its lookup family: every round
the decoder proposes a lookup continuation (free: microseconds), and the pricing cuts it at
the γ maximising ``E[γ] / t_verify(γ + 1, n)`` with ``E`` from the online, per-bucket
acceptance estimates (:class:`~knapspec.drafters.acceptance.LookupAcceptance`) and
``t_verify`` from the cost model. γ = 0 (one plain step, ``1 / t_step(n)``) is one of the
cuts, so a proposal that does not pay is not drafted.

:class:`LookupPlanner` (``"lookup"``) is the ablation every paper on prompt lookup starts
from: draft up to a fixed ``k`` lookup tokens whenever the suffix matches. It drafts with
any drafter that proposes before planning (``drafter``), so a new drafter can be tried
with it before a planner prices it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import attrs
import numpy as np

from knapspec.drafters.acceptance import (
    BranchAcceptance,
    LookupAcceptance,
    LookupAcceptanceConfig,
)
from knapspec.drafters.base import LOOKUP
from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.objective import FloatArray, best_chained_length
from knapspec.types import DraftPlan, DraftTree, StepOutcome
from knapspec.validators import at_least, non_empty_string

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel

#: The most tree nodes one verification holds (the row-invariant kernel's bound on the
#: rows of one pass is 64: the nodes and the pending token).
MAX_TREE_NODES = 63


@attrs.frozen
class LookupOption:
    """The priced lookup proposal of one round.

    Attributes:
        draft_length: the TPT-optimal cut γ (0: not worth drafting).
        tokens_per_second: predicted TPT at that cut.
        plain_tokens_per_second: ``1 / t_step(n)``, the γ = 0 reference.
        best_draft_tokens_per_second: the best predicted TPT of a cut with γ >= 1.
        acceptance: ``(L,)`` the conditional acceptance used per position.
        bucket: the acceptance bucket of the proposal.
        tree_nodes: the proposal tree's nodes to verify when branches pay (then
            ``draft_length`` is their deepest path); None: a chain of ``draft_length``.
        expected_tokens: the predicted tokens per round of a tree cut (None for a chain).
    """

    draft_length: int
    tokens_per_second: float
    plain_tokens_per_second: float
    best_draft_tokens_per_second: float
    acceptance: FloatArray
    bucket: int
    tree_nodes: tuple[int, ...] | None = None
    expected_tokens: float | None = None

    def beats(self, other: LookupOption) -> bool:
        """Whether this cut is predicted faster than ``other``'s (a drafted cut beats an
        undrafted one at equal speed)."""
        return (self.tokens_per_second, self.draft_length > 0) > (
            other.tokens_per_second,
            other.draft_length > 0,
        )

    @property
    def mean_acceptance(self) -> float:
        """Mean conditional acceptance over the drafted positions (for the plan record)."""
        if self.draft_length == 0:
            return float(self.acceptance[0]) if self.acceptance.size else 0.0
        return float(self.acceptance[: self.draft_length].mean())


class LookupPricing:
    """Online acceptance + cost model -> the TPT-optimal cut of each lookup proposal.

    Args:
        config: the acceptance estimator's hyper-parameters.
    """

    def __init__(self, config: LookupAcceptanceConfig | None = None) -> None:
        self.acceptance = LookupAcceptance(config)
        self.branches = BranchAcceptance(self.acceptance.config)

    def reset(self) -> None:
        self.acceptance.reset()
        self.branches.reset()

    def price(
        self, context: PlanningContext, cost_model: CostModel, max_draft: int, drafter: str = LOOKUP
    ) -> LookupOption | None:
        """Price this round's proposal by ``drafter`` (None when there is none)."""
        proposal = context.proposal(drafter)
        if proposal is None or not proposal.tokens or max_draft < 1:
            return None
        length = min(len(proposal.tokens), max_draft)
        bucket = self.acceptance.bucket(proposal.match_length)
        rates = self.acceptance.conditional(bucket, length)
        n = context.context_length
        verify = np.array(
            [cost_model.step_cost(n)]
            + [cost_model.verify_cost(k + 1, n) for k in range(1, length + 1)],
            dtype=np.float64,
        )
        gamma, tpt = best_chained_length(rates, verify)
        chain = LookupOption(
            draft_length=gamma,
            tokens_per_second=float(tpt[gamma]),
            plain_tokens_per_second=float(tpt[0]),
            best_draft_tokens_per_second=float(tpt[1:].max()),
            acceptance=rates,
            bucket=bucket,
        )
        if proposal.tree is None or not context.trees:
            return chain
        tree = self._price_tree(proposal.tree, chain, cost_model, n, max_draft)
        return tree if tree is not None and tree.beats(chain) else chain

    def _price_tree(
        self,
        tree: DraftTree,
        chain: LookupOption,
        cost_model: CostModel,
        n: int,
        max_draft: int,
    ) -> LookupOption | None:
        """The TPT-best subtree: for each size, the nodes most likely on the accepted path.

        A node's probability of lying on the accepted path is the product of the
        conditional acceptances along its path (a heaviest child: the chain's rate at its
        depth; a side branch: :class:`BranchAcceptance`). The expected accepted drafts of
        a node set is the sum of those probabilities, so for each size ``m`` the best set
        is the ``m`` most probable nodes (ancestor-closed: a child is never likelier than
        its parent). The cut maximises ``(1 + E[accepted]) / t_verify(m + 1, n)``."""
        depths = tree.depths
        deepest = min(max(depths), max_draft)
        rates = self.acceptance.conditional(chain.bucket, deepest)
        match_bucket = chain.bucket // 2
        on_path = np.zeros(len(tree))
        for i, (parent, depth) in enumerate(zip(tree.parents, depths, strict=True)):
            if depth > deepest:
                continue  # deeper than the round may draft: never kept
            rate = float(rates[depth - 1])
            if tree.rank[i] > 0:
                rate = self.branches.rate(match_bucket, tree.support[i], depth, rate)
            on_path[i] = rate * (on_path[parent] if parent >= 0 else 1.0)
        order = sorted(
            (i for i in range(len(tree)) if depths[i] <= deepest), key=lambda i: (-on_path[i], i)
        )[:MAX_TREE_NODES]
        if not order:
            return None
        expected = 1.0 + np.cumsum(on_path[order])
        verify = np.array([cost_model.verify_cost(m + 2, n) for m in range(len(order))])
        tpt = expected / verify
        best = int(tpt.argmax())
        kept = tuple(sorted(order[: best + 1]))
        if tree.subtree(kept).is_chain:
            return None  # the chain option prices it
        return LookupOption(
            draft_length=max(depths[i] for i in kept),
            tokens_per_second=float(tpt[best]),
            plain_tokens_per_second=chain.plain_tokens_per_second,
            best_draft_tokens_per_second=max(chain.best_draft_tokens_per_second, float(tpt[best])),
            acceptance=chain.acceptance,
            bucket=chain.bucket,
            tree_nodes=kept,
            expected_tokens=float(expected[best]),
        )

    def observe(self, outcome: StepOutcome, drafter: str = LOOKUP) -> None:
        """Learn from the round in hindsight (``drafter``'s proposal vs committed tokens)."""
        for draft in outcome.proposals:
            if draft.drafter == drafter:
                bucket = self.acceptance.bucket(draft.match_length)
                self.acceptance.observe_round(
                    draft.tokens, draft.match_length, outcome.committed_tokens
                )
                if draft.tree is not None:
                    self.branches.observe_round(draft.tree, bucket // 2, outcome.committed_tokens)
                return
        self.acceptance.observe_round((), 0, outcome.committed_tokens)


@attrs.frozen
class LookupPlannerConfig:
    """Hyper-parameters of :class:`LookupPlanner`.

    Attributes:
        draft_length: k, the lookup tokens drafted whenever the suffix matches (>= 1).
        drafter: the registered drafter whose proposals are drafted; it must propose
            before planning (``"lookup"``, or a drafter of your own).
    """

    draft_length: int = attrs.field(default=3, validator=at_least(1))
    drafter: str = attrs.field(default=LOOKUP, validator=non_empty_string)


@PLANNERS.register("lookup")
class LookupPlanner(Planner):
    """Fixed-length prompt lookup: up to ``k`` tokens of the drafter's proposal every round
    it proposes any, no pricing (the baseline the knapsack planner's TPT cut is compared
    against)."""

    config_class = LookupPlannerConfig
    uses_window = False

    def __init__(self, config: LookupPlannerConfig | None = None) -> None:
        self.config = config if config is not None else LookupPlannerConfig()

    def proposal_drafters(self) -> frozenset[str]:
        return frozenset({self.config.drafter})

    def plan_drafters(self) -> frozenset[str]:
        return self.proposal_drafters()  # it never plans a sublayer mask

    def plan(self, context: PlanningContext) -> DraftPlan:
        layers = context.engine.num_layers
        proposal = context.proposal(self.config.drafter)
        if proposal is None or not proposal.tokens:
            return DraftPlan.autoregressive(layers, source="lookup")
        length = min(self.config.draft_length, len(proposal.tokens), context.max_draft_length)
        return _fixed_plan(layers, length, self.config.drafter)


@functools.lru_cache(maxsize=256)
def _fixed_plan(num_layers: int, draft_length: int, drafter: str) -> DraftPlan:
    """A fixed-length plan (plans are immutable and shared, like the γ = 0 plan)."""
    base = DraftPlan.autoregressive(num_layers, source="lookup")
    return attrs.evolve(base, draft_length=draft_length, drafter=drafter)


def lookup_plan(
    num_layers: int,
    draft_length: int,
    source: str,
    predicted_acceptance: float | None = None,
    predicted_tokens_per_second: float | None = None,
    drafter: str = LOOKUP,
    tree_nodes: tuple[int, ...] | None = None,
) -> DraftPlan:
    """A plan drafting ``draft_length`` tokens of ``drafter``'s proposal (lookup by
    default) with the planner's predictions; with ``tree_nodes``, those nodes of its
    token tree (``draft_length``: their deepest path)."""
    base = DraftPlan.autoregressive(num_layers, source=source)
    return attrs.evolve(
        base,
        draft_length=draft_length,
        drafter=drafter,
        predicted_acceptance=predicted_acceptance,
        predicted_tokens_per_second=predicted_tokens_per_second,
        tree_nodes=tree_nodes,
    )


__all__ = [
    "LookupOption",
    "LookupPlanner",
    "LookupPlannerConfig",
    "LookupPricing",
    "lookup_plan",
]
