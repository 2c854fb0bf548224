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
  chooses ``G = 0`` by itself. The cost model prices one sequence; how far a batched pass
  strays from that price is learned from every pass the batch runs
  (:class:`BatchPassCalibration`), so a wide draft that proved dear is priced as it ran.
* :class:`FixedLookupBatchPolicy` drafts up to ``k`` lookup tokens in every row with a
  match (the fixed-length ablation; the tests use it to force ragged acceptance).
* :class:`PlainBatchPolicy` never drafts.

Layer-skipping sub-network drafts are not run in batches (see the user guide).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import attrs
import numpy as np

from knapspec.costmodels.base import CostModel
from knapspec.drafters.acceptance import LookupAcceptance
from knapspec.drafters.base import Draft
from knapspec.planners.objective import chained_expected_tokens
from knapspec.validators import unit_interval


def batched_verify_cost(cost_model: CostModel, rows: int, tokens: int, context: int) -> float:
    """Predicted seconds of one verify pass over ``rows`` rows of ``tokens`` tokens each at
    a mean context ``context``: the products over all ``rows · tokens`` tokens plus each
    row's own attention (the context-dependent part of a ``tokens``-wide verification)."""
    products = cost_model.verify_cost(rows * tokens, 0)
    attention = cost_model.verify_cost(tokens, context) - cost_model.verify_cost(tokens, 0)
    return products + rows * max(attention, 0.0)


@attrs.define
class BatchPassCalibration:
    """Measured / predicted seconds of batched verification passes, learned online.

    The cost model is fitted on single sequences; a batched pass (``rows × width`` tokens,
    each row attending over its own cache) runs other kernel shapes. On a 2-core AMD EPYC
    the prediction was up to 1.5x low for 8 rows × 5 tokens at 2k context and right for
    8 rows × 1 token, so uncorrected the policy drafted where drafting lost. Each pass's
    ratio enters an exponential average keyed by the pass's total tokens ``rows · width``;
    a size not seen yet borrows the ratio of the nearest size seen (in log scale), and
    before any pass the ratio is 1 (the cost model as it is). A draft the cost model makes
    look cheap is thus tried, then priced by what it really cost.

    Attributes:
        smoothing: weight of the newest pass in the average, in (0, 1].
        ratios: total tokens per pass -> smoothed measured / predicted seconds.
    """

    smoothing: float = attrs.field(default=0.3, validator=unit_interval)
    ratios: dict[int, float] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.smoothing <= 0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def observe(self, tokens: int, predicted: float, seconds: float) -> None:
        """Fold one pass of ``tokens`` total tokens into the average (ignored when either
        time is not positive: nothing to learn from it)."""
        if tokens < 1 or predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        old = self.ratios.get(tokens)
        self.ratios[tokens] = ratio if old is None else old + self.smoothing * (ratio - old)

    def factor(self, tokens: int) -> float:
        """The correction for a pass of ``tokens`` total tokens (1.0 before any pass)."""
        if not self.ratios:
            return 1.0
        if tokens in self.ratios:
            return self.ratios[tokens]
        nearest = min(self.ratios, key=lambda seen: (abs(math.log(seen / tokens)), seen))
        return self.ratios[nearest]


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

    def observe_pass(self, rows: int, width: int, context: int, seconds: float) -> None:
        """A batched verification of ``rows`` rows × ``width`` tokens at mean context
        ``context`` took ``seconds``."""
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
        calibration: the learned correction of batched pass costs; pass the same object
            to the next batch's policy to keep what it learned (the decoder does).
    """

    def __init__(
        self,
        cost_model: CostModel,
        max_draft_length: int,
        margin: float = 0.05,
        calibration: BatchPassCalibration | None = None,
    ) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.cost_model = cost_model
        self.max_draft_length = max_draft_length
        self.margin = margin
        self.calibration = calibration if calibration is not None else BatchPassCalibration()
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
            tpt.append(tokens / (cost * self.calibration.factor(count * (cap + 1))))
        self.last_tokens_per_second = tpt
        best = int(np.argmax(tpt))
        if best == 0 or tpt[best] < (1.0 + self.margin) * tpt[0]:
            return [0] * count
        return [min(best, len(proposal)) for proposal in proposals]

    def observe(self, row: int, proposal: Draft, committed: Sequence[int]) -> None:
        self.acceptance[row].observe_round(proposal.tokens, proposal.match_length, committed)

    def observe_pass(self, rows: int, width: int, context: int, seconds: float) -> None:
        predicted = batched_verify_cost(self.cost_model, rows, width, context)
        self.calibration.observe(rows * width, predicted, seconds)


__all__ = [
    "BatchDraftPolicy",
    "BatchPassCalibration",
    "CostModelBatchPolicy",
    "FixedLookupBatchPolicy",
    "PlainBatchPolicy",
    "batched_verify_cost",
]
