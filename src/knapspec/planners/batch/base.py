"""What a batch loop asks a batch policy each round, and the policies that need no search.

A batched round verifies every active row in one full-model pass, row ``r`` feeding
``1 + γ_r`` tokens; a :class:`BatchDraftPolicy` chooses each row's ``γ_r`` and drafter for
that round (:meth:`~BatchDraftPolicy.plan_round`) and hears back what the round committed
and cost (the ``observe`` hooks, no-ops by default). The policies here decide without
pricing anything:

* :class:`PlainBatchPolicy` never drafts.
* :class:`FixedLookupBatchPolicy` drafts up to ``k`` lookup tokens in every row with a
  match (the fixed-length ablation; tests force ragged acceptance with it).
* :class:`FixedSubnetworkBatchPolicy` drafts ``k`` sub-network tokens in every row (the
  batched counterpart of the static planner; the tests use it to force layer-skip drafts).

The search that prices each round,
:class:`~knapspec.planners.batch.policy.CostModelBatchPolicy`, lives in
:mod:`~knapspec.planners.batch.policy`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from knapspec.drafters.base import Draft
from knapspec.planners.batch.plan import BatchSubnetwork, RoundPlan


class BatchDraftPolicy(abc.ABC):
    """Chooses each active row's draft length γ_r (and drafter) for one batched round.

    A policy that only drafts lookup tokens implements :meth:`draft_lengths`; one that
    also drafts with the sub-network overrides :meth:`plan_round`.
    """

    #: The sub-network on offer in this batch (None: lookup drafts only).
    subnetwork: BatchSubnetwork | None = None

    def reset(self, rows: int) -> None:
        """Start a batch of ``rows`` rows (forget per-row state)."""
        return None

    def use_subnetwork(self, subnetwork: BatchSubnetwork | None) -> None:
        """Offer ``subnetwork`` to the rounds of this batch (None withdraws it); called
        after :meth:`reset`."""
        self.subnetwork = subnetwork

    def plan_round(
        self,
        rows: Sequence[int],
        proposals: Sequence[Draft],
        context_lengths: Sequence[int],
        rooms: Sequence[int],
    ) -> RoundPlan:
        """This round's plan: by default each row's :meth:`draft_lengths` lookup tokens.

        Args:
            rows, proposals, context_lengths: as :meth:`draft_lengths`.
            rooms: per active row, the most tokens it may draft (token limit, context).
        """
        return RoundPlan.lookup(self.draft_lengths(rows, proposals, context_lengths))

    @abc.abstractmethod
    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        """Per active row, how many of its proposal's tokens to draft (0..len(proposal)).

        Args:
            rows: the active rows' indices in the batch (their order in the step).
            proposals: each active row's lookup proposal (maybe empty).
            context_lengths: each active row's committed tokens.
        """

    def observe(self, row: int, proposal: Draft, committed: Sequence[int]) -> None:
        """Row ``row``'s round is done: its proposal and the tokens it committed."""
        return None

    def observe_pass(
        self,
        rows: int,
        width: int,
        context: int,
        seconds: float,
        widths: Sequence[int] | None = None,
    ) -> None:
        """A batched verification of ``rows`` rows padded to ``width`` tokens (row ``r``
        feeding ``widths[r]`` real tokens; all ``width`` when None) at mean context
        ``context`` took ``seconds``."""
        return None

    def observe_subnetwork(self, row: int, drafted: int, accepted: int) -> None:
        """Row ``row`` drafted ``drafted`` sub-network tokens and ``accepted`` of them
        were accepted."""
        return None

    def observe_draft_pass(self, rows: int, context: int, seconds: float) -> None:
        """One batched sub-network step over ``rows`` rows at mean context ``context``
        took ``seconds``."""
        return None


class PlainBatchPolicy(BatchDraftPolicy):
    """γ = 0 for every row: batched plain decoding."""

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        return [0] * len(proposals)


class _FixedLengthPolicy(BatchDraftPolicy):
    """A policy that drafts a fixed ``draft_length`` (k >= 1) tokens where it drafts."""

    def __init__(self, draft_length: int = 3) -> None:
        if draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {draft_length}")
        self.draft_length = draft_length


class FixedLookupBatchPolicy(_FixedLengthPolicy):
    """Up to ``draft_length`` lookup tokens in every row whose suffix matches.

    Args:
        draft_length: k >= 1.
    """

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        return [min(self.draft_length, len(proposal)) for proposal in proposals]


class FixedSubnetworkBatchPolicy(_FixedLengthPolicy):
    """``draft_length`` sub-network tokens in every row each round (as far as the row's
    room allows); nothing while no sub-network is on offer.

    Args:
        draft_length: k >= 1.
    """

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        return [0] * len(proposals)

    def plan_round(
        self,
        rows: Sequence[int],
        proposals: Sequence[Draft],
        context_lengths: Sequence[int],
        rooms: Sequence[int],
    ) -> RoundPlan:
        if self.subnetwork is None:
            return RoundPlan.lookup([0] * len(rows))
        lengths = tuple(min(self.draft_length, room) for room in rooms)
        return RoundPlan(lengths, tuple(length > 0 for length in lengths))
