"""The batch search: how many tokens each row of a batch drafts, priced as a whole.

A batched round verifies every active row in one full-model pass: row ``r`` feeds
``1 + γ_r`` tokens; the linear products run over the ``Σ_r (1 + γ_r)`` real tokens packed
together, attention over the rows padded to ``q = 1 + max_r γ_r``. Its cost is one number
for the whole batch, so the decision is made at batch level.

:class:`CostModelBatchPolicy` (the default whenever the decoder has a cost model) chooses
each row's ``γ_r``: drafting ``k`` lookup tokens, row ``r`` commits ``E_r(k)`` tokens in
expectation, from its own online per-bucket acceptance
(:class:`~knapspec.drafters.acceptance.LookupAcceptance`), the extra tokens scaled by what
the chosen drafts have delivered (:class:`DraftRealism`). The round's cost is the cost
model's verify cost split into the products over all ``T = Σ_r (1 + γ_r)`` packed tokens
and each row's attention over its own cache (:func:`packed_verify_cost`). For each cap
``G`` on the padded width it takes the rows' marginal gains ``E_r(k) - E_r(k - 1)``
largest first (they fall along each row, so the first ``m`` are the best ``m`` draft
tokens of the batch) and keeps the count of the highest tokens per second
``Σ_r E_r(γ_r) / cost``. It drafts only when the best round beats the plain batch step
(all ``γ_r = 0``) by ``margin``; a wide batch, whose products have left the few-row regime
where extra tokens are nearly free, chooses ``G = 0`` by itself. How far batched passes
stray from the cost model's price is learned from every pass
(:class:`BatchPassCalibration`). With a layer-skipping sub-network on offer
(:class:`BatchSubnetwork`, the mask the decoder's planner chose on the batch's first row),
every cap is also priced with the sub-network drafting up to ``G`` tokens in one batched
masked pass per token (:func:`batched_draft_cost`) for the rows whose expected tokens
``Σ_{i≤γ} α_r^i`` beat their lookup allocation's.

The interface every policy implements (:class:`BatchDraftPolicy`) and the policies that
decide without pricing (:class:`PlainBatchPolicy`, :class:`FixedLookupBatchPolicy`,
:class:`FixedSubnetworkBatchPolicy`) live in :mod:`~knapspec.planners.batch.base`; this
module re-exports them, so it names every batch policy. A round's choice is a
:class:`RoundPlan` (each row's γ, and its drafter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from knapspec.costmodels.base import CostModel
from knapspec.drafters.acceptance import LookupAcceptance
from knapspec.drafters.base import Draft
from knapspec.planners.batch.allocation import (
    best_lookup_allocations,
    greedy_order,
    lookup_bound,
)
from knapspec.planners.batch.base import (
    BatchDraftPolicy,
    FixedLookupBatchPolicy,
    FixedSubnetworkBatchPolicy,
    PlainBatchPolicy,
)
from knapspec.planners.batch.plan import (
    BatchSubnetwork,
    DraftRealism,
    RoundPlan,
    SubnetworkAcceptance,
)
from knapspec.planners.batch.pricing import (
    BatchPassCalibration,
    RoundPrices,
    batched_draft_cost,
    batched_verify_cost,
    packed_verify_cost,
)
from knapspec.planners.objective import chained_expected_tokens

FloatArray = np.ndarray[Any, np.dtype[np.float64]]


class CostModelBatchPolicy(BatchDraftPolicy):
    """The batch-level TPT search over every row's draft length (module docstring).

    Args:
        cost_model: prices each round (:func:`batched_verify_cost`,
            :func:`batched_draft_cost`).
        max_draft_length: D, the largest cap.
        margin: the predicted gain over the plain batch step a draft must show (0.05:
            5 %, the knapsack planner's margin).
        calibration: the learned correction of batched verification costs; pass the same
            object to the next batch's policy to keep what it learned (the decoder does).
        draft_calibration: the same for batched sub-network steps (keyed by rows).
        lookup: whether rows may draft their proposals (lookup's or any drafter's that
            proposes before planning; False: the shared sub-network only).
        explore_plain: where a round would draft but fewer than
            :data:`~knapspec.planners.batch.pricing.PLAIN_SAMPLES` plain passes of that many
            rows have run, run it plain (its price is otherwise borrowed from drafted
            passes, or rests on one sample; :class:`BatchPassCalibration`).
        realism: what the chosen lookup drafts brought against their estimates
            (:class:`DraftRealism`); the decoder passes one object to every batch.
    """

    def __init__(
        self,
        cost_model: CostModel,
        max_draft_length: int,
        margin: float = 0.05,
        calibration: BatchPassCalibration | None = None,
        draft_calibration: BatchPassCalibration | None = None,
        *,
        lookup: bool = True,
        explore_plain: bool = True,
        realism: DraftRealism | None = None,
    ) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.cost_model = cost_model
        self.max_draft_length = max_draft_length
        self.margin = margin
        self.lookup = lookup
        self.explore_plain = explore_plain
        self.calibration = calibration if calibration is not None else BatchPassCalibration()
        self.draft_calibration = (
            draft_calibration if draft_calibration is not None else BatchPassCalibration()
        )
        self.acceptance: list[LookupAcceptance] = []
        self.subnetwork_acceptance: list[SubnetworkAcceptance] = []
        self.realism = realism if realism is not None else DraftRealism()
        # Row -> the extra tokens (E_r(γ_r) - 1) the last plan expected of its lookup draft.
        self._expected: dict[int, float] = {}
        #: The last round's predicted tokens per second: ``"plain"`` (γ = 0) and the best
        #: round found with the rows' ``"proposals"`` / the shared drafter's (by its name,
        #: ``"subnetwork"``) drafts (diagnostics).
        self.last_tokens_per_second: dict[str, float] = {}

    def reset(self, rows: int) -> None:
        self.acceptance = [LookupAcceptance() for _ in range(rows)]
        self.subnetwork_acceptance = []
        self.subnetwork = None
        self._expected = {}

    def use_subnetwork(self, subnetwork: BatchSubnetwork | None) -> None:
        self.subnetwork = subnetwork
        self.subnetwork_acceptance = []
        if subnetwork is not None:
            prior = (subnetwork.prior_acceptance, subnetwork.prior_tokens)
            self.subnetwork_acceptance = [SubnetworkAcceptance(*prior) for _ in self.acceptance]

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        """Lookup tokens only (the search without the sub-network)."""
        rooms = [len(proposal) for proposal in proposals]
        plan = self._search(rows, proposals, context_lengths, rooms, subnetwork=False)
        return list(plan.draft_lengths)

    def plan_round(
        self,
        rows: Sequence[int],
        proposals: Sequence[Draft],
        context_lengths: Sequence[int],
        rooms: Sequence[int],
    ) -> RoundPlan:
        return self._search(rows, proposals, context_lengths, rooms, subnetwork=True)

    def _lookup_gains(
        self, rows: Sequence[int], proposals: Sequence[Draft]
    ) -> tuple[list[FloatArray], list[int]]:
        """Per row, expected committed tokens by lookup γ (``gain[k]``), and the most
        lookup tokens it can draft. The extra tokens past the one a round always commits
        are scaled by :attr:`realism`'s factor."""
        realism = self.realism.factor()
        gains: list[FloatArray] = []
        lengths: list[int] = []
        for row, proposal in zip(rows, proposals, strict=True):
            length = min(len(proposal), self.max_draft_length) if self.lookup else 0
            lengths.append(length)
            if length == 0:
                gains.append(np.ones(1))
                continue
            estimator = self.acceptance[row]
            rates = estimator.conditional(estimator.bucket(proposal.match_length), length)
            gains.append(1.0 + realism * (chained_expected_tokens(rates) - 1.0))
        return gains, lengths

    def _search(
        self,
        rows: Sequence[int],
        proposals: Sequence[Draft],
        context_lengths: Sequence[int],
        rooms: Sequence[int],
        *,
        subnetwork: bool,
    ) -> RoundPlan:
        """The round of the highest predicted tokens per second (module docstring).

        For each cap ``G`` (the padded width ``G + 1`` fixes the attention's cost), every
        row's lookup increments ``E_r(k) - E_r(k - 1)``, ``k <= min(G, len_r)``, are
        taken largest first: they fall along each row, so the first ``m`` of them are
        the best ``m`` extra tokens over the batch, and the products cost only their
        count (they run packed). With a sub-network on offer, the rows it serves better
        than their lookup tokens switch to it at ``min(G, room_r)`` tokens.
        """
        count = len(proposals)
        nothing = RoundPlan.lookup([0] * count)
        self._expected.clear()  # a row that left unobserved (it failed) leaves nothing stale
        gains, lookup_lengths = self._lookup_gains(rows, proposals)
        offer = self.subnetwork if subnetwork else None
        longest = max(lookup_lengths, default=0)
        if offer is not None:
            longest = max(longest, min(self.max_draft_length, max(rooms, default=0)))
        if longest == 0:
            self.last_tokens_per_second = {}
            return nothing
        prices = RoundPrices(
            self.cost_model,
            count,
            round(sum(context_lengths) / count),
            self.calibration,
            self.draft_calibration,
            offer.mask if offer is not None else None,
        )
        plain = count / prices.round(count, 1, 0)
        alphas = [self.subnetwork_acceptance[row].rate for row in rows] if offer else []
        best_tpt, best_plan = plain, nothing
        best_of = {"plain": plain}
        order = greedy_order(gains, lookup_lengths, longest)  # sorted once, for every cap
        if offer is None and lookup_bound(count, order, prices) < (1.0 + self.margin) * plain:
            self.last_tokens_per_second = best_of
            return nothing
        allocations = best_lookup_allocations(gains, lookup_lengths, longest, prices, order)
        for cap, (tpt, gammas) in enumerate(allocations, start=1):
            if tpt > best_of.get("proposals", 0.0):
                best_of["proposals"] = tpt
            if tpt > best_tpt:
                best_tpt, best_plan = tpt, RoundPlan.lookup(gammas)
            if offer is None:
                continue
            option = self._subnetwork_option(cap, rooms, alphas, gains, gammas, prices)
            if option is not None:
                if option[0] > best_of.get(offer.drafter, 0.0):
                    best_of[offer.drafter] = option[0]
                if option[0] > best_tpt:
                    best_tpt, best_plan = option
        self.last_tokens_per_second = best_of
        if best_tpt < (1.0 + self.margin) * plain:
            return nothing
        if self.explore_plain and not self.calibration.plain_known(count):
            # Too few plain passes of this many rows have run, so their price is borrowed
            # from drafted passes or rests on one sample (:class:`BatchPassCalibration`):
            # run plain until measured can be compared with measured.
            return nothing
        for slot, (row, gamma, sub) in enumerate(
            zip(rows, best_plan.draft_lengths, best_plan.subnetwork_rows, strict=True)
        ):
            if gamma and not sub:
                self._expected[row] = float(gains[slot][gamma]) - 1.0
        return best_plan

    def _subnetwork_option(
        self,
        cap: int,
        rooms: Sequence[int],
        alphas: Sequence[float],
        gains: Sequence[FloatArray],
        lookup_gammas: Sequence[int],
        prices: RoundPrices,
    ) -> tuple[float, RoundPlan] | None:
        """The round with the sub-network drafting up to ``cap`` tokens for the rows it
        serves better than their lookup allocation ``lookup_gammas``; None when it serves
        none."""
        gammas, uses, tokens = [], [], 0.0
        for alpha, room, gain, lookup in zip(alphas, rooms, gains, lookup_gammas, strict=True):
            sub = min(cap, room)
            sub_tokens = float(np.sum(alpha ** np.arange(sub + 1)))
            use = sub > 0 and sub_tokens > float(gain[lookup])
            uses.append(use)
            gammas.append(sub if use else lookup)
            tokens += sub_tokens if use else float(gain[lookup])
        if not any(uses):
            return None
        steps = max(g for g, use in zip(gammas, uses, strict=True) if use)
        attended = sum(prices.attention(1 + gamma) for gamma in gammas)
        cost = prices.round(len(gammas) + sum(gammas), 1 + max(gammas), steps, attended)
        return tokens / cost, RoundPlan(tuple(gammas), tuple(uses))

    def observe(self, row: int, proposal: Draft, committed: Sequence[int]) -> None:
        self.acceptance[row].observe_round(proposal.tokens, proposal.match_length, committed)
        expected = self._expected.pop(row, None)
        if expected is not None:
            self.realism.observe(expected, max(len(committed) - 1, 0))

    def observe_pass(
        self,
        rows: int,
        width: int,
        context: int,
        seconds: float,
        widths: Sequence[int] | None = None,
    ) -> None:
        row_widths = list(widths) if widths is not None else [width] * rows
        predicted = packed_verify_cost(self.cost_model, row_widths, context)
        self.calibration.observe(sum(row_widths), predicted, seconds, rows=len(row_widths))
        if max(row_widths) == 1:
            self.calibration.observe_plain(len(row_widths))

    def observe_subnetwork(self, row: int, drafted: int, accepted: int) -> None:
        if self.subnetwork_acceptance:
            self.subnetwork_acceptance[row].observe(drafted, accepted)

    def observe_draft_pass(self, rows: int, context: int, seconds: float) -> None:
        if self.subnetwork is None:
            return
        predicted = batched_draft_cost(self.cost_model, self.subnetwork.mask, rows, context)
        self.draft_calibration.observe(rows, predicted, seconds)


__all__ = [
    "BatchDraftPolicy",
    "BatchPassCalibration",
    "BatchSubnetwork",
    "CostModelBatchPolicy",
    "DraftRealism",
    "FixedLookupBatchPolicy",
    "FixedSubnetworkBatchPolicy",
    "PlainBatchPolicy",
    "RoundPlan",
    "SubnetworkAcceptance",
    "batched_draft_cost",
    "batched_verify_cost",
    "packed_verify_cost",
]
