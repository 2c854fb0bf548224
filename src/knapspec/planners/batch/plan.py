"""The records a batched round is planned with: the sub-network on offer, each row's
acceptance of it, and the round's plan."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import attrs

from knapspec.types import SUBNETWORK, SublayerMask
from knapspec.validators import interval


@attrs.frozen
class BatchSubnetwork:
    """The layer-skipping draft a batch may use: one mask, shared by the rows that draft
    with it in a round.

    Attributes:
        mask: the sub-network (items it runs).
        prior_acceptance: per-token acceptance expected before any round (the planner's
            prediction where it made one).
        prior_tokens: weight of that prior, in drafted tokens.
        source: who chose the mask (a planner's name), for the stats.
        drafter: the registered drafter that drafts under the mask, one that drafts a
            batch's rows together (``Drafter.drafts_rows_together``).
    """

    mask: SublayerMask
    prior_acceptance: float = attrs.field(
        default=0.5, validator=interval(0.0, 1.0, low_open=True, high_open=True)
    )
    prior_tokens: float = attrs.field(default=4.0, validator=interval(0.0, math.inf))
    source: str = ""
    drafter: str = SUBNETWORK


@attrs.define
class SubnetworkAcceptance:
    """One row's per-token acceptance of sub-network drafts: a Beta posterior mean.

    A round that drafted ``k`` tokens and accepted ``a`` of them shows ``a`` acceptances
    and, when ``a < k``, one rejection (later tokens were never tested), so
    ``α = (m·α₀ + accepted) / (m + accepted + rejections)`` with the prior ``α₀`` of
    weight ``m`` tokens.
    """

    prior_acceptance: float
    prior_tokens: float
    accepted: int = 0
    rejections: int = 0

    @property
    def rate(self) -> float:
        """The current estimate of α, in (0, 1)."""
        weight = self.prior_tokens
        seen = self.accepted + self.rejections
        if weight + seen <= 0:
            return self.prior_acceptance
        return (weight * self.prior_acceptance + self.accepted) / (weight + seen)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified round of ``drafted`` sub-network tokens."""
        self.accepted += accepted
        self.rejections += int(accepted < drafted)


@attrs.define
class DraftRealism:
    """How many of the extra tokens the policy expected of the lookup drafts it chose were
    committed: ``Σ realized / Σ expected`` over the last ``window`` drafted rows.

    The policy drafts the rows and lengths whose estimated gains are largest, so the
    estimates it acts on are the lucky ones (the winner's curse), and a fresh row's
    estimates are its priors. In closed bursts of requests the chosen drafts' rounds
    commit fewer tokens than expected, and with the pass priced low as well, drafting
    looks better than plain decoding where it runs worse (figures:
    ``results/engine/HISTORY.md``, "Figures behind docstrings"). Scaling every row's extra
    tokens by this factor turns the search's estimates into what the chosen drafts have
    delivered.

    Attributes:
        window: drafted rows the factor is taken over.
        min_expected: expected extra tokens seen before the factor departs from 1.
        low, high: bounds of the factor (one unlucky stretch does not stop drafting for
            good: a draft priced at a quarter of its estimate still runs where it pays).
    """

    window: int = attrs.field(default=256, validator=interval(1, math.inf))
    min_expected: float = attrs.field(default=16.0, validator=interval(0.0, math.inf))
    low: float = attrs.field(default=0.25, validator=interval(0.0, 1.0, low_open=True))
    high: float = attrs.field(default=1.5, validator=interval(1.0, math.inf))
    _recent: deque[tuple[float, int]] = attrs.field(init=False, repr=False)
    _expected: float = attrs.field(default=0.0, init=False, repr=False)
    _realized: int = attrs.field(default=0, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._recent = deque()

    def observe(self, expected: float, realized: int) -> None:
        """One drafted row's round: ``expected`` extra tokens, ``realized`` committed
        past the first."""
        self._recent.append((expected, realized))
        self._expected += expected
        self._realized += realized
        if len(self._recent) > self.window:
            old_expected, old_realized = self._recent.popleft()
            self._expected -= old_expected
            self._realized -= old_realized

    def factor(self) -> float:
        """The scale of the extra tokens (1.0 until ``min_expected`` were expected)."""
        if self._expected < max(self.min_expected, 1e-9):
            return 1.0
        return min(max(self._realized / self._expected, self.low), self.high)


@attrs.frozen
class RoundPlan:
    """What a batched round drafts, per active row (in the step's order).

    Attributes:
        draft_lengths: γ_r (0 for a plain step).
        subnetwork_rows: True where row ``r`` drafts its γ_r tokens with the sub-network
            (else with its lookup proposal).
    """

    draft_lengths: tuple[int, ...]
    subnetwork_rows: tuple[bool, ...]

    @classmethod
    def lookup(cls, lengths: Sequence[int]) -> RoundPlan:
        """Every row drafts its lookup proposal's first γ_r tokens."""
        return cls(tuple(lengths), (False,) * len(lengths))

    @property
    def draft_steps(self) -> int:
        """Batched sub-network steps the round runs (the longest sub-network draft)."""
        return max(
            (g for g, sub in zip(self.draft_lengths, self.subnetwork_rows, strict=True) if sub),
            default=0,
        )


__all__ = ["BatchSubnetwork", "DraftRealism", "RoundPlan", "SubnetworkAcceptance"]
