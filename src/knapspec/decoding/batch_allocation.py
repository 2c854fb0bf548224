"""The best lookup allocation of one batched round under a cap on the widest row.

:class:`~knapspec.decoding.batch_policy.CostModelBatchPolicy` asks, for each cap ``G``,
how many lookup tokens each row should draft (``γ_r <= G``) to maximise the round's
predicted tokens per second; this module answers with a greedy pass over the rows'
marginal gains plus anchored candidates (one row at the cap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from knapspec.decoding.batch_pricing import RoundPrices

FloatArray = np.ndarray[Any, np.dtype[np.float64]]

#: Rows tried as the one drafting the cap in the lookup search (those of the largest gain
#: at the cap): every row in batches up to this size.
ANCHOR_ROWS = 8


def _gammas(count: int, taken: Sequence[tuple[float, int]]) -> list[int]:
    """Per row, how many of the ``taken`` (increment, row) pairs are its."""
    gammas = [0] * count
    for _, row in taken:
        gammas[row] += 1
    return gammas


def best_lookup_allocation(
    gains: Sequence[FloatArray], lengths: Sequence[int], cap: int, prices: RoundPrices
) -> tuple[float, list[int]]:
    """The best lookup allocation with every γ_r <= ``cap``: its tokens per second and
    the γ_r (all 0 when no extra token pays)."""
    count = len(gains)
    increments = sorted(
        (
            (float(gain[k] - gain[k - 1]), row)
            for row, (gain, length) in enumerate(zip(gains, lengths, strict=True))
            for k in range(1, min(cap, length) + 1)
        ),
        key=lambda item: -item[0],  # stable: a row's increments stay in order
    )
    counts = [0] * count
    tokens, widest = float(count), 0
    best_tpt, best_m = tokens / prices.round(count, 1, 0), 0
    attended = count * prices.attention(1)  # Σ_r attention(1 + γ_r), as γ grows
    for m, (increment, row) in enumerate(increments, start=1):
        tokens += increment
        attended += prices.attention(counts[row] + 2) - prices.attention(counts[row] + 1)
        counts[row] += 1
        widest = max(widest, counts[row])
        tpt = tokens / prices.round(count + m, 1 + widest, 0, attended)
        if tpt > best_tpt:
            best_tpt, best_m = tpt, m
    gammas = [0] * count
    for _, row in increments[:best_m]:
        gammas[row] += 1
    # The largest increments first can spread tokens over rows where one row drafting
    # all ``cap`` is cheaper (a pass whose padding would double its tokens attends row
    # by row, priced at each row's own width). For each row as the anchor at ``cap``,
    # add the others' largest increments: with attention linear in the width, a
    # round's price depends only on the token count and the widest row, so these
    # candidates hold the most tokens for every (count, widest = cap) pair.
    prefix = [
        float(gain[cap] - gain[0]) if length >= cap else -1.0
        for gain, length in zip(gains, lengths, strict=True)
    ]
    anchors = sorted(range(count), key=lambda row: -prefix[row])[:ANCHOR_ROWS]
    for anchor in anchors:
        if prefix[anchor] < 0.0:
            break
        tokens = count + prefix[anchor]
        attended = count * prices.attention(1) + (prices.attention(cap + 1) - prices.attention(1))
        taken = [(0.0, anchor)] * cap
        tpt = tokens / prices.round(count + cap, 1 + cap, 0, attended)
        if tpt > best_tpt:
            best_tpt, gammas = tpt, _gammas(count, taken)
        others = [item for item in increments if item[1] != anchor]
        counts = [0] * count
        for increment, row in others:
            tokens += increment
            attended += prices.attention(counts[row] + 2) - prices.attention(counts[row] + 1)
            counts[row] += 1
            taken.append((increment, row))
            tpt = tokens / prices.round(count + len(taken), 1 + cap, 0, attended)
            if tpt > best_tpt:
                best_tpt, gammas = tpt, _gammas(count, taken)
    return best_tpt, gammas


__all__ = ["ANCHOR_ROWS", "best_lookup_allocation"]
