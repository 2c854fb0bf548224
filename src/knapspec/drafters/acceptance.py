"""Online acceptance estimates for lookup drafts, learned from every round in hindsight.

A lookup proposal is made before every round, whether or not the round drafts with it.
Once the round has committed its tokens (target tokens: accepted drafts plus the
correction or bonus token), comparing them with the proposal tells how many of its tokens
the target would have accepted: token ``j`` is accepted with probability ``p_j(x_j)`` (q is
one-hot), and the committed token ``j`` is a sample of ``p_j`` given the same prefix, so
"equal" is an unbiased draw of that event, greedy or sampled. The estimator therefore
learns during plain steps too, and notices by itself when a γ = 0 stretch should end.

Estimates are kept per *bucket*: the measured match length (1, 2, 3, 4-7, 8-15, 16+
tokens) × whether the previous round's proposal matched everything committed (a copy
streak). Within a bucket, the acceptance of position ``j`` given positions ``< j`` were
accepted is a Beta estimate shrunk to the bucket's pooled rate, itself shrunk to a prior
that rises with the match length. Counts decay geometrically, so the estimate follows the
regime of the current output.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from knapspec.types import DraftTree
from knapspec.validators import at_least, interval

FloatArray = npt.NDArray[np.float64]


def _probabilities(
    instance: object, attribute: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]
) -> None:
    if not value or not all(isinstance(p, (int, float)) and 0.0 < p < 1.0 for p in value):
        raise ValueError(
            f"{attribute.name} must be a non-empty list of values in (0, 1), got {list(value)}"
        )


def _rising_edges(
    instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    edges = tuple(value)
    integers = all(isinstance(e, int) and not isinstance(e, bool) for e in edges)
    if (
        not edges
        or not integers
        or edges[0] != 1
        or any(b <= a for a, b in itertools.pairwise(edges))
    ):
        raise ValueError(
            f"{attribute.name} must be integers rising strictly from 1, got {list(edges)}"
        )


def check_priors_match_buckets(
    edges: Sequence[int], priors: Sequence[float], edges_name: str, priors_name: str
) -> None:
    """One prior per match-length bucket (a check across two fields, so not a validator)."""
    if len(priors) != len(edges):
        raise ValueError(
            f"{priors_name} needs one value per match-length bucket of {edges_name} "
            f"({len(edges)}: {list(edges)}), got {len(priors)}"
        )


@attrs.frozen
class LookupAcceptanceConfig:
    """Hyper-parameters of :class:`LookupAcceptance`.

    In a config file they are the knapsack planner's ``lookup_*`` fields (the planner
    prices lookup drafts with them): ``planner.lookup_prior_acceptance`` and so on.

    Attributes:
        match_edges: lower edges of the match-length buckets (integers rising strictly
            from 1; ``(1, 2, 4)`` gives the buckets 1, 2-3 and 4+ matched tokens).
        prior_acceptance: per bucket, the prior per-token acceptance (each in (0, 1); one
            value per edge).
        prior_strength: pseudo-trials of the prior in a bucket's pooled rate (> 0).
        position_strength: pseudo-trials of the pooled rate in each position's rate (> 0).
        decay: every observed round multiplies all counts by this, in (0, 1] (1 = never
            forget).
        max_positions: draft positions tracked separately (>= 1; later ones share the last).
    """

    match_edges: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 8, 16), converter=tuple, validator=_rising_edges
    )
    prior_acceptance: tuple[float, ...] = attrs.field(
        default=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8), converter=tuple, validator=_probabilities
    )
    prior_strength: float = attrs.field(
        default=2.0, validator=interval(0.0, math.inf, low_open=True)
    )
    position_strength: float = attrs.field(
        default=2.0, validator=interval(0.0, math.inf, low_open=True)
    )
    decay: float = attrs.field(default=0.99, validator=interval(0.0, 1.0, low_open=True))
    max_positions: int = attrs.field(default=16, validator=at_least(1))

    def __attrs_post_init__(self) -> None:
        check_priors_match_buckets(
            self.match_edges, self.prior_acceptance, "match_edges", "prior_acceptance"
        )


def hindsight_matches(proposal: Sequence[int], committed: Sequence[int]) -> tuple[int, bool]:
    """``(matched, rejected)``: leading proposal tokens equal to the committed tokens, and
    whether a mismatch was seen (False when the comparison ran out: censored)."""
    matched = 0
    limit = min(len(proposal), len(committed))
    while matched < limit and proposal[matched] == committed[matched]:
        matched += 1
    return matched, matched < limit


class LookupAcceptance:
    """Per-bucket, per-position acceptance of lookup draft tokens (see module docstring).

    Args:
        config: hyper-parameters (:class:`LookupAcceptanceConfig`).
    """

    def __init__(self, config: LookupAcceptanceConfig | None = None) -> None:
        self.config = config if config is not None else LookupAcceptanceConfig()
        self.reset()

    @property
    def num_buckets(self) -> int:
        return 2 * len(self.config.match_edges)

    def reset(self) -> None:
        shape = (self.num_buckets, self.config.max_positions)
        self.accepted_: FloatArray = np.zeros(shape)
        self.trials_: FloatArray = np.zeros(shape)
        self.streak_ = False
        self.observed_rounds_ = 0

    def bucket(self, match_length: int, streak: bool | None = None) -> int:
        """Bucket of a proposal with this match length (under the current streak state).

        A drafter that measures no match (``Draft.match_length`` 0: not a lookup) falls
        in the first bucket, so any proposing drafter is priced by the same estimates."""
        index = max(0, bisect.bisect_right(self.config.match_edges, match_length) - 1)
        on_streak = self.streak_ if streak is None else streak
        return 2 * index + int(on_streak)

    def conditional(self, bucket: int, length: int) -> FloatArray:
        """``(length,)`` P(position ``j`` accepted | positions ``< j`` accepted)."""
        config = self.config
        prior = config.prior_acceptance[bucket // 2]
        accepted, trials = self.accepted_[bucket], self.trials_[bucket]
        pooled = (accepted.sum() + config.prior_strength * prior) / (
            trials.sum() + config.prior_strength
        )
        rates = (accepted + config.position_strength * pooled) / (trials + config.position_strength)
        positions = np.minimum(np.arange(length), config.max_positions - 1)
        result: FloatArray = rates[positions]
        return result

    def observe(self, bucket: int, matched: int, rejected: bool) -> None:
        """One proposal's hindsight: positions ``< matched`` accepted, and position
        ``matched`` rejected when ``rejected``."""
        config = self.config
        self.accepted_ *= config.decay
        self.trials_ *= config.decay
        last = config.max_positions - 1
        for position in range(matched):
            j = min(position, last)
            self.accepted_[bucket, j] += 1.0
            self.trials_[bucket, j] += 1.0
        if rejected:
            self.trials_[bucket, min(matched, last)] += 1.0
        self.observed_rounds_ += 1

    def observe_round(
        self, proposal: Sequence[int], match_length: int, committed: Sequence[int]
    ) -> None:
        """Learn from a round: the proposal made before it (full length, not the part
        drafted) against the tokens it committed; updates the copy-streak state."""
        matched, rejected = hindsight_matches(proposal, committed)
        if proposal:
            self.observe(self.bucket(match_length), matched, rejected)
        self.streak_ = bool(proposal) and bool(committed) and not rejected


#: Lower edges of the support bins of :class:`BranchAcceptance` (a branch's weighted share
#: of the occurrences that reach its parent).
SUPPORT_EDGES = (0.0, 0.25, 0.5, 0.75)


class BranchAcceptance:
    """Acceptance of a token tree's side branches, learned online like the chain's.

    A side branch is a node that is not its parent's heaviest child (``rank > 0``); the
    heaviest children follow the chain's estimates (:class:`LookupAcceptance`). Per match
    bucket, support bin (:data:`SUPPORT_EDGES`) and depth, the estimate of ``P(node
    accepted | parent accepted)`` is a Beta mean shrunk (``position_strength``
    pseudo-trials) to a prior: the chain's rate at that depth times the node's support
    (the target follows the occurrences in proportion to their weight). Counts decay as
    the chain's do. In hindsight every side node whose parent lies on the committed path
    is one trial: accepted when its token is the committed one (greedy or sampled, as
    for the chain: its ``q`` is one-hot).

    Args:
        config: the chain's hyper-parameters (shared: buckets, strength, decay).
    """

    def __init__(self, config: LookupAcceptanceConfig | None = None) -> None:
        self.config = config if config is not None else LookupAcceptanceConfig()
        self.reset()

    def reset(self) -> None:
        shape = (len(self.config.match_edges), len(SUPPORT_EDGES), self.config.max_positions)
        self.accepted_: FloatArray = np.zeros(shape)
        self.trials_: FloatArray = np.zeros(shape)

    def _cell(self, match_bucket: int, support: float, depth: int) -> tuple[int, int, int]:
        support_bin = max(0, bisect.bisect_right(SUPPORT_EDGES, support) - 1)
        return match_bucket, support_bin, min(depth - 1, self.config.max_positions - 1)

    def rate(self, match_bucket: int, support: float, depth: int, chain_rate: float) -> float:
        """``P(accepted | parent accepted)`` of a side node at ``depth >= 1`` with this
        support, given the chain's conditional rate at that depth."""
        cell = self._cell(match_bucket, support, depth)
        strength = self.config.position_strength
        prior = chain_rate * support
        return float((self.accepted_[cell] + strength * prior) / (self.trials_[cell] + strength))

    def observe_round(self, tree: DraftTree, match_bucket: int, committed: Sequence[int]) -> None:
        """Learn from a round: ``tree`` (the whole proposal) against the committed tokens."""
        self.accepted_ *= self.config.decay
        self.trials_ *= self.config.decay
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(tree.parents):
            children.setdefault(parent, []).append(i)
        node = -1
        for depth, token in enumerate(committed, start=1):
            follow = -1
            for child in children.get(node, ()):
                hit = tree.tokens[child] == token
                if hit:
                    follow = child
                if tree.rank[child] > 0:
                    cell = self._cell(match_bucket, tree.support[child], depth)
                    self.trials_[cell] += 1.0
                    self.accepted_[cell] += float(hit)
            if follow < 0:
                return
            node = follow


__all__ = [
    "SUPPORT_EDGES",
    "BranchAcceptance",
    "LookupAcceptance",
    "LookupAcceptanceConfig",
    "check_priors_match_buckets",
    "hindsight_matches",
]
