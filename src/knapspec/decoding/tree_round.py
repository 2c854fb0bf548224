"""One token-tree verification round: the tree pass, the walk, the cache compaction.

A lookup proposal's token tree (:class:`~knapspec.types.DraftTree`) is verified in one
full-model pass with tree attention (:meth:`SublayerEngine.forward_tree`); the sampler
walks it (:meth:`TokenSampler.verify_tree`); the cache keeps the accepted path's K/V only
(:meth:`KVCache.compact`). ``docs/theory.md`` ("Token trees") says why this is lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.costmodels.base import LatencyObservation
from knapspec.decoding.greedy import greedy_ids
from knapspec.errors import NonFiniteLogitsError
from knapspec.types import DraftTree, Verification
from knapspec.validators import check_finite

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.decoding.sampler import TokenSampler
    from knapspec.decoding.stats import GenerationStats
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine


@attrs.frozen
class TreeRoundParts:
    """What a tree round uses of its call: the engine, the sequence's cache, its sampler,
    the call's stats and cost model, and the clock."""

    engine: SublayerEngine
    cache: KVCache
    sampler: TokenSampler
    stats: GenerationStats
    cost_model: CostModel | None
    clock: Callable[[], float]


@attrs.frozen
class TreeVerification(Verification):
    """A :class:`~knapspec.types.Verification` of a tree round, with the accepted nodes
    (``path``, root side first)."""

    path: tuple[int, ...] = ()


def verify_tree_round(
    parts: TreeRoundParts, tree: DraftTree, pending: int, n: int, capture: bool
) -> TreeVerification:
    """Verify ``tree`` after ``pending`` (at position ``n``; the cache holds ``n`` tokens)
    and leave the cache holding ``n + 1 + accepted`` tokens: ``pending`` and the accepted
    path. With ``capture``, the window data (points and target argmaxes) of the path's
    rows, as a chain round returns them for its accepted prefix. Counts the round in the
    stats and feeds the cost model (if any) the pass's latency.
    """
    started = parts.clock()
    inputs = torch.tensor([pending, *tree.tokens], device=parts.engine.device)
    parents = [-1, *(parent + 1 for parent in tree.parents)]
    out = parts.engine.forward_tree(inputs, n, parents, parts.cache, capture_points=capture)
    check_finite(out.logits, "verification", error=NonFiniteLogitsError.during)
    verdict, path = parts.sampler.verify_tree(tree, out.logits, n + 1)
    rows = [0, *(node + 1 for node in path)]
    parts.cache.compact(n, rows)
    points = out.points[:, rows] if out.points is not None else None
    target_next = greedy_ids(out.logits[rows]) if capture else None
    elapsed = parts.clock() - started
    parts.stats.verify_time_s += elapsed
    parts.stats.record_tree(tree, path)
    if parts.cost_model is not None:
        parts.cost_model.observe(LatencyObservation("verify", n, elapsed, len(inputs)))
    return TreeVerification(
        verdict.accepted, verdict.tokens, elapsed, points, target_next, tuple(path)
    )


__all__ = ["TreeRoundParts", "TreeVerification", "verify_tree_round"]
