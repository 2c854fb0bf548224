"""The best lookup allocation of one batched round under a cap on the widest row.

:class:`~knapspec.planners.batch.policy.CostModelBatchPolicy` asks, for each cap ``G``,
how many lookup tokens each row should draft (``γ_r <= G``) to maximise the round's
predicted tokens per second; this module answers with a greedy pass over the rows'
marginal gains plus anchored candidates (one row at the cap).

Every candidate of a pass is priced at once in NumPy (:meth:`RoundPrices.rounds`): the
running token count, widest row and attended seconds of the greedy order are cumulative
sums and maxima, evaluated in the order the step-by-step loop added them, so the prices
and the choice are bitwise the loop's (``tests/test_batch_allocation.py`` keeps that loop as
the oracle). The loop's Python would be paid by every batched round, drafted or not, a
visible share of a wide round (figures: ``results/engine/HISTORY.md``, "Figures behind
docstrings").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knapspec.planners.batch.pricing import FloatArray, IntArray, RoundPrices

#: Rows tried as the one drafting the cap in the lookup search (those of the largest gain
#: at the cap): every row in batches up to this size.
ANCHOR_ROWS = 8


GreedyOrder = tuple[FloatArray, IntArray, IntArray]
_NONE: FloatArray = np.zeros(0)


def greedy_order(gains: Sequence[FloatArray], lengths: Sequence[int], cap: int) -> GreedyOrder:
    """Every row's increments ``E_r(k) - E_r(k - 1)``, ``k <= min(cap, len_r)``, largest
    first (stable: a row's increments, which do not grow with ``k``, stay in order). The
    order for a smaller cap is this one without the increments past it, so a search over
    caps sorts once (:func:`best_lookup_allocation`'s ``order``).

    Returns:
        the increments, their rows and their ``k`` (the row's γ once it is taken).
    """
    increments: list[FloatArray] = []
    for gain, length in zip(gains, lengths, strict=True):
        top = min(cap, length)
        increments.append(
            np.diff(np.asarray(gain[: top + 1], dtype=np.float64)) if top >= 1 else _NONE
        )
    return order_increments(increments)


def order_increments(increments: Sequence[FloatArray]) -> GreedyOrder:
    """Row ``r``'s draft tokens, ``increments[r][k - 1]`` the expected tokens its ``k``-th
    adds, every row's largest first; ties keep row-major order (a stable sort), so the
    first ``m`` are the batch's best ``m`` draft tokens when each row's increments do not
    grow with ``k``. :func:`greedy_order` and the vLLM proposer's batch pricing
    (:func:`knapspec.integrations.vllm_pricing.price_batch`) both take their order here.

    Returns:
        the increments, their rows and their ``k`` (the row's γ once it is taken).
    """
    values: list[FloatArray] = []
    rows: list[IntArray] = []
    depths: list[IntArray] = []
    for row, increment in enumerate(increments):
        count = len(increment)
        if count < 1:
            continue
        values.append(np.asarray(increment, dtype=np.float64))
        rows.append(np.full(count, row, dtype=np.int64))
        depths.append(np.arange(1, count + 1, dtype=np.int64))
    if not values:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0), empty, empty
    value = np.concatenate(values)
    order = np.argsort(-value, kind="stable")
    return value[order], np.concatenate(rows)[order], np.concatenate(depths)[order]


def _order_within(
    gains: Sequence[FloatArray], lengths: Sequence[int], cap: int, order: GreedyOrder | None
) -> GreedyOrder:
    """``order`` (made when None) without the increments deeper than ``cap``."""
    increments, owners, depths = order if order is not None else greedy_order(gains, lengths, cap)
    if len(depths) and int(depths.max()) > cap:
        within = depths <= cap
        return increments[within], owners[within], depths[within]
    return increments, owners, depths


def lookup_bound(count: int, order: GreedyOrder, prices: RoundPrices) -> float:
    """An upper bound on the tokens per second of every lookup allocation the search
    (:func:`best_lookup_allocation`, any cap) can choose from ``order``.

    Any ``m`` drafted tokens bring at most the ``m`` largest increments (each row's fall
    along it), and a pass of ``count + m`` tokens costs at least its products and every
    row's attention at width 1 (attention grows with the width). Where even this bound
    does not beat the plain step by the policy's margin, the search is skipped: in a wide
    batch it costs a visible share of every round, drafted or not (figures:
    ``results/engine/HISTORY.md``, "Figures behind docstrings").
    """
    increments = order[0]
    tokens = np.cumsum(np.concatenate(([float(count)], increments)))
    real = count + np.arange(len(increments) + 1)
    attended = np.full(len(real), count * float(prices.attention_table(1)[1]))
    return float(np.max(tokens / prices.rounds(real, 1, attended)))


def best_lookup_allocation(
    gains: Sequence[FloatArray],
    lengths: Sequence[int],
    cap: int,
    prices: RoundPrices,
    order: GreedyOrder | None = None,
) -> tuple[float, list[int]]:
    """The best lookup allocation with every γ_r <= ``cap``: its tokens per second and
    the γ_r (all 0 when no extra token pays). ``order``: :func:`greedy_order` for this cap
    or a larger one (made here when None)."""
    count = len(gains)
    increments, owners, depths = _order_within(gains, lengths, cap, order)
    n = len(increments)
    attention = prices.attention_table(cap + 1)  # attention[w]: one row at width w
    base_attended = count * float(attention[1])
    # Taking a row's k-th token moves its attention from width k to k + 1.
    steps = attention[depths + 1] - attention[depths]
    # The greedy order: the largest increments first, the widest row as it grows.
    tokens = np.cumsum(np.concatenate(([float(count)], increments)))
    attended = np.cumsum(np.concatenate(([base_attended], steps)))
    widest = 1 + np.maximum.accumulate(np.concatenate(([0], depths)))
    real = count + np.arange(n + 1)
    greedy = tokens / prices.rounds(real, widest, attended)
    best_m = int(np.argmax(greedy))
    best_tpt = float(greedy[best_m])
    gammas = np.bincount(owners[:best_m], minlength=count).tolist()
    # The largest increments first can spread tokens over rows where one row drafting
    # all ``cap`` is cheaper (a pass whose padding would double its tokens attends row
    # by row, priced at each row's own width). For each row as the anchor at ``cap``,
    # add the others' largest increments: with attention linear in the width, a
    # round's price depends only on the token count and the widest row, so these
    # candidates hold the most tokens for every (count, widest = cap) pair. All anchors
    # at once: anchor ``a``'s order is the greedy one without its own increments (a
    # skipped element adds 0.0, which leaves every running sum bitwise as it was).
    prefix = np.array(
        [
            float(gain[cap] - gain[0]) if length >= cap else -1.0
            for gain, length in zip(gains, lengths, strict=True)
        ]
    )
    anchors = [row for row in np.argsort(-prefix, kind="stable")[:ANCHOR_ROWS] if prefix[row] >= 0]
    if not anchors:
        return best_tpt, [int(g) for g in gammas]
    chosen = np.array(anchors)
    others = owners[None, :] != chosen[:, None]  # (a, n)
    start_tokens = count + prefix[chosen]
    start_attended = np.full(
        len(chosen), base_attended + (float(attention[cap + 1]) - float(attention[1]))
    )
    tokens2 = np.cumsum(
        np.concatenate((start_tokens[:, None], np.where(others, increments, 0.0)), axis=1), axis=1
    )
    attended2 = np.cumsum(
        np.concatenate((start_attended[:, None], np.where(others, steps, 0.0)), axis=1), axis=1
    )
    taken = np.concatenate(
        (np.zeros((len(chosen), 1), dtype=np.int64), np.cumsum(others, axis=1)), axis=1
    )
    tpt = tokens2 / prices.rounds(count + cap + taken, 1 + cap, attended2)
    # Only the prefixes that end on one of the anchor's own elements (or none) exist.
    valid = np.concatenate((np.ones((len(chosen), 1), dtype=bool), others), axis=1)
    tpt = np.where(valid, tpt, -np.inf)
    flat = int(np.argmax(tpt))  # the first of equals, anchor by anchor, as the loop's
    if tpt.flat[flat] > best_tpt:
        a, j = divmod(flat, n + 1)
        best_tpt = float(tpt.flat[flat])
        gammas = np.bincount(owners[:j][others[a, :j]], minlength=count).tolist()
        gammas[anchors[a]] = cap
    return best_tpt, [int(g) for g in gammas]


def best_lookup_allocations(
    gains: Sequence[FloatArray],
    lengths: Sequence[int],
    caps: int,
    prices: RoundPrices,
    order: GreedyOrder | None = None,
) -> list[tuple[float, list[int]]]:
    """:func:`best_lookup_allocation` for every cap ``1 .. caps`` at once: entry ``G - 1``
    is bitwise its answer for cap ``G`` (``order``: :func:`greedy_order` for ``caps`` or
    more). One pass of NumPy over ``(caps, anchors, increments)`` instead of a pass per cap:
    each pass is a few dozen small array operations, whose fixed cost adds up to a visible
    share of a small batch's round (figures: ``results/engine/HISTORY.md``, "Figures
    behind docstrings"). A cap's increments are the order's of depth ``<= G``; the
    others add ``0.0`` to every running sum (which leaves it bitwise as it was) and repeat
    the candidate before them, so the first best candidate is always one the cap has."""
    count = len(gains)
    increments, owners, depths = _order_within(gains, lengths, caps, order)
    n = len(increments)
    attention = prices.attention_table(caps + 1)
    base_attended = count * float(attention[1])
    steps = attention[depths + 1] - attention[depths]
    cap_values = np.arange(1, caps + 1)
    inside = depths[None, :] <= cap_values[:, None]  # (G, n): the cap's increments
    zero_column = np.zeros((caps, 1))
    tokens = np.cumsum(
        np.concatenate((zero_column + count, np.where(inside, increments, 0.0)), axis=1), axis=1
    )
    attended = np.cumsum(
        np.concatenate((zero_column + base_attended, np.where(inside, steps, 0.0)), axis=1), axis=1
    )
    widest = 1 + np.maximum.accumulate(
        np.concatenate((np.zeros((caps, 1), dtype=np.int64), np.where(inside, depths, 0)), axis=1),
        axis=1,
    )
    taken: IntArray = np.concatenate(
        (np.zeros((caps, 1), dtype=np.int64), np.cumsum(inside, axis=1, dtype=np.int64)), axis=1
    )
    greedy = tokens / prices.rounds(count + taken, widest, attended)
    best_m = np.argmax(greedy, axis=1)
    results: list[tuple[float, list[int]]] = []
    for g in range(caps):
        m = int(best_m[g])
        chosen = owners[:m][inside[g, :m]]
        results.append((float(greedy[g, m]), np.bincount(chosen, minlength=count).tolist()))
    # Anchors: per cap, the rows whose whole prefix to the cap is the largest (as there).
    prefix = np.array(
        [
            [float(gain[cap] - gain[0]) if length >= cap else -1.0 for cap in cap_values]
            for gain, length in zip(gains, lengths, strict=True)
        ]
    ).reshape(count, caps)  # (rows, G)
    ranked = np.argsort(-prefix, axis=0, kind="stable")[:ANCHOR_ROWS]  # (A, G)
    anchor_rows = ranked.T  # (G, A)
    usable = np.take_along_axis(prefix.T, anchor_rows, axis=1) >= 0  # (G, A)
    if not usable.any():
        return [(tpt, [int(g) for g in gammas]) for tpt, gammas in results]
    others = inside[:, None, :] & (owners[None, None, :] != anchor_rows[:, :, None])  # (G, A, n)
    start_tokens = count + np.take_along_axis(prefix.T, anchor_rows, axis=1)  # (G, A)
    start_attended = base_attended + (attention[cap_values + 1] - float(attention[1]))  # (G,)
    tokens2 = np.cumsum(
        np.concatenate((start_tokens[:, :, None], np.where(others, increments, 0.0)), axis=2),
        axis=2,
    )
    attended2 = np.cumsum(
        np.concatenate(
            (
                np.broadcast_to(start_attended[:, None, None], (*anchor_rows.shape, 1)),
                np.where(others, steps, 0.0),
            ),
            axis=2,
        ),
        axis=2,
    )
    taken2 = np.concatenate(
        (np.zeros((*anchor_rows.shape, 1), dtype=np.int64), np.cumsum(others, axis=2)), axis=2
    )
    widths = np.broadcast_to(1 + cap_values[:, None, None], taken2.shape)
    tpt = tokens2 / prices.rounds(count + cap_values[:, None, None] + taken2, widths, attended2)
    valid = np.concatenate((usable[:, :, None], others & usable[:, :, None]), axis=2)
    tpt = np.where(valid, tpt, -np.inf).reshape(caps, -1)
    flat = np.argmax(tpt, axis=1)  # the first of equals, anchor by anchor, as there
    final: list[tuple[float, list[int]]] = []
    for g in range(caps):
        best_tpt, gammas = results[g]
        value = float(tpt[g, flat[g]])
        if value > best_tpt:
            a, j = divmod(int(flat[g]), n + 1)
            best_tpt = value
            gammas = np.bincount(owners[:j][others[g, a, :j]], minlength=count).tolist()
            gammas[int(anchor_rows[g, a])] = g + 1
        final.append((best_tpt, [int(x) for x in gammas]))
    return final


__all__ = [
    "ANCHOR_ROWS",
    "GreedyOrder",
    "best_lookup_allocation",
    "best_lookup_allocations",
    "greedy_order",
    "lookup_bound",
    "order_increments",
]
