"""How many lookup tokens each row of a batch drafts this round.

A batched round verifies every active row in one full-model pass over ``rows × q``
tokens, ``q = 1 + max_r γ_r`` (rows are padded to the longest draft). Its cost is one
number for the whole batch, so the decision is made at batch level:

* :class:`CostModelBatchPolicy` (the default whenever the decoder has a cost model) tries
  every cap ``G ∈ {0..D}``: row ``r`` drafts ``γ_r = min(G, len(proposal_r))`` (a row
  drafting fewer than the longest costs nothing more, its slots are computed anyway) and
  commits ``E_r(γ_r)`` tokens in expectation, from its own online per-bucket acceptance
  (:class:`~knapspec.drafters.acceptance.LookupAcceptance`, learned in hindsight from
  every round, drafted or not). The round's cost comes from the cost model's verify
  costs, split into the part that does not grow with the context and the part that does
  (:func:`batched_verify_cost`): the linear products see all ``rows · (G + 1)`` tokens at
  once, ``verify_cost(rows · (G + 1), 0)``, and every row attends over its own cache,
  ``rows · (verify_cost(G + 1, n̄) - verify_cost(G + 1, 0))`` at the rows' mean context
  ``n̄``. It picks the ``G`` of the highest tokens per second ``Σ_r E_r(γ_r) / cost(G)``,
  and drafts only when that beats the plain batch step (``G = 0``) by ``margin``. The
  wider the batch, the more a draft token costs relative to what one row gains (the
  products leave the few-row regime where extra rows are nearly free), so a large batch
  chooses ``G = 0`` by itself.
* :class:`FixedLookupBatchPolicy` drafts up to ``k`` lookup tokens in every row with a
  match (the fixed-length ablation; the tests use it to force ragged acceptance).
* :class:`PlainBatchPolicy` never drafts.

Layer-skipping sub-network drafts are not run in batches (see the user guide).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from knapspec.costmodels.base import CostModel
from knapspec.drafters.acceptance import LookupAcceptance
from knapspec.drafters.base import Draft
from knapspec.planners.objective import chained_expected_tokens


def batched_verify_cost(cost_model: CostModel, rows: int, tokens: int, context: int) -> float:
    """Predicted seconds of one verify pass over ``rows`` rows of ``tokens`` tokens each at
    a mean context ``context``: the products over all ``rows · tokens`` tokens plus each
    row's own attention (the context-dependent part of a ``tokens``-wide verification)."""
    products = cost_model.verify_cost(rows * tokens, 0)
    attention = cost_model.verify_cost(tokens, context) - cost_model.verify_cost(tokens, 0)
    return products + rows * max(attention, 0.0)


class BatchDraftPolicy(abc.ABC):
    """Chooses each active row's draft length γ_r for one batched round."""

    def reset(self, rows: int) -> None:
        """Start a batch of ``rows`` rows (forget per-row state)."""
        return None

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


class PlainBatchPolicy(BatchDraftPolicy):
    """γ = 0 for every row: batched plain decoding."""

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        return [0] * len(proposals)


class FixedLookupBatchPolicy(BatchDraftPolicy):
    """Up to ``draft_length`` lookup tokens in every row whose suffix matches.

    Args:
        draft_length: k >= 1.
    """

    def __init__(self, draft_length: int = 3) -> None:
        if draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {draft_length}")
        self.draft_length = draft_length

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        return [min(self.draft_length, len(proposal)) for proposal in proposals]


class CostModelBatchPolicy(BatchDraftPolicy):
    """The batch-level TPT search over a common cap ``G`` (module docstring).

    Args:
        cost_model: prices each round (:func:`batched_verify_cost`).
        max_draft_length: D, the largest cap.
        margin: the predicted gain over the plain batch step a draft must show (0.05:
            5 %, the knapsack planner's margin).
    """

    def __init__(self, cost_model: CostModel, max_draft_length: int, margin: float = 0.05) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.cost_model = cost_model
        self.max_draft_length = max_draft_length
        self.margin = margin
        self.acceptance: list[LookupAcceptance] = []
        #: The last round's predicted tokens per second per cap ``G = 0..D`` (diagnostics).
        self.last_tokens_per_second: list[float] = []

    def reset(self, rows: int) -> None:
        self.acceptance = [LookupAcceptance() for _ in range(rows)]

    def draft_lengths(
        self, rows: Sequence[int], proposals: Sequence[Draft], context_lengths: Sequence[int]
    ) -> list[int]:
        count = len(proposals)
        longest = min(self.max_draft_length, max((len(p) for p in proposals), default=0))
        if longest == 0:
            return [0] * count
        # gains[r][k]: row r's expected committed tokens when it drafts k tokens.
        gains = []
        for row, proposal in zip(rows, proposals, strict=True):
            length = min(len(proposal), longest)
            if length == 0:
                gains.append(np.ones(1))
                continue
            estimator = self.acceptance[row]
            rates = estimator.conditional(estimator.bucket(proposal.match_length), length)
            gains.append(chained_expected_tokens(rates))
        context = round(sum(context_lengths) / count)
        tpt = []
        for cap in range(longest + 1):
            tokens = sum(float(gain[min(cap, gain.size - 1)]) for gain in gains)
            cost = batched_verify_cost(self.cost_model, count, cap + 1, context)
            tpt.append(tokens / cost)
        self.last_tokens_per_second = tpt
        best = int(np.argmax(tpt))
        if best == 0 or tpt[best] < (1.0 + self.margin) * tpt[0]:
            return [0] * count
        return [min(best, len(proposal)) for proposal in proposals]

    def observe(self, row: int, proposal: Draft, committed: Sequence[int]) -> None:
        self.acceptance[row].observe_round(proposal.tokens, proposal.match_length, committed)


__all__ = [
    "BatchDraftPolicy",
    "CostModelBatchPolicy",
    "FixedLookupBatchPolicy",
    "PlainBatchPolicy",
    "batched_verify_cost",
]
