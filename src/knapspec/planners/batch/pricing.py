"""What batched rounds cost: the cost model's single-sequence prices turned into a batch's.

A batched verification runs its linear products once over the rows' real tokens (packed)
and each row's attention over its own cache, at the padded width, or at the row's own
width where the pass splits its attention (:func:`packed_verify_cost`,
:func:`~knapspec.model.passes.batched.splits_attention`); a batched sub-network step scales
the mask's products from one row to all rows as verification scales
(:func:`batched_draft_cost`). How far real batched passes stray from those prices is
learned online (:class:`BatchPassCalibration`), and one round's queries are made once
(:class:`RoundPrices`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from knapspec.costmodels.base import CostModel
from knapspec.model.passes.batched import SPLIT_PADDING_FACTOR, splits_attention
from knapspec.types import SublayerMask

FloatArray = np.ndarray[Any, np.dtype[np.float64]]
IntArray = np.ndarray[Any, np.dtype[np.int64]]


def batched_verify_cost(cost_model: CostModel, rows: int, tokens: int, context: int) -> float:
    """Predicted seconds of one verify pass over ``rows`` rows of ``tokens`` tokens each at
    a mean context ``context``: the products over all ``rows · tokens`` tokens plus each
    row's own attention (the context-dependent part of a ``tokens``-wide verification)."""
    return packed_verify_cost(cost_model, [tokens] * rows, context)


def packed_verify_cost(cost_model: CostModel, widths: Sequence[int], context: int) -> float:
    """Predicted seconds of one verify pass whose row ``r`` feeds ``widths[r]`` tokens, at
    a mean context ``context``: the products over the ``Σ widths`` real tokens (the batch
    packs them) plus every row's attention, at the padded width ``max(widths)`` or, where
    the pass splits its attention, at its own width."""
    width, tokens = max(widths), sum(widths)
    products = cost_model.verify_cost(tokens, 0)
    if splits_attention(len(widths), width, tokens):
        return products + sum(row_attention_cost(cost_model, w, context) for w in widths)
    return products + len(widths) * row_attention_cost(cost_model, width, context)


def row_attention_cost(cost_model: CostModel, width: int, context: int) -> float:
    """Predicted seconds of one row's attention for ``width`` new tokens over ``context``
    cached ones: the context-dependent part of a ``width``-token verification."""
    return max(cost_model.verify_cost(width, context) - cost_model.verify_cost(width, 0), 0.0)


def batched_draft_cost(cost_model: CostModel, mask: SublayerMask, rows: int, context: int) -> float:
    """Predicted seconds of one batched draft step of ``mask`` over ``rows`` rows (one
    token each) at a mean context ``context``: the mask's products, scaled from one row to
    ``rows`` rows as the cost model's verification scales (few-row products stream each
    weight once), plus each row's own attention over its cache."""
    products = cost_model.draft_cost(mask, 0)
    attention = cost_model.draft_cost(mask, context) - products
    one_row = cost_model.verify_cost(1, 0)
    scale = cost_model.verify_cost(rows, 0) / one_row if one_row > 0 else float(rows)
    return products * scale + rows * max(attention, 0.0)


#: A batched pass's cell in :class:`BatchPassCalibration`: a number (rows of a draft step),
#: or a verification's ``(rows, drafted)``.
PassSize = int | tuple[int, bool]

#: Plain passes of a row count the policy runs before it trusts their price
#: (:attr:`BatchPassCalibration.plain_passes`): the median of three survives one outlier.
PLAIN_SAMPLES = 3


@attrs.define
class BatchPassCalibration:
    """Measured / predicted seconds of batched verification passes, learned online.

    The cost model is fitted on single sequences; a batched pass (``rows × width`` tokens,
    each row attending over its own cache) runs other kernel shapes. Its prediction can be
    well low for rows of several tokens at a long context and right for rows of one token,
    so uncorrected the policy drafts where drafting loses. Each pass's ratio is kept per
    size, and a size's correction is the median of its last ``window`` ratios; a size not
    seen yet borrows the correction of the nearest size seen (in log scale), and before any
    pass it is 1 (the cost model as it is). A draft the cost model makes look cheap is thus
    tried, then priced by what it really cost.

    A verification pass is sized by its row count and whether it drafted
    (``observe(tokens, ..., rows=rows)``: the cell ``(rows, drafted)``; an unseen cell
    borrows the nearest, a row count's log distance plus :data:`KIND_DISTANCE` between
    kinds). Keyed by the total tokens alone, a plain pass of 16 rows and a drafted pass of
    6 rows feeding 16 tokens would share one correction though the first pays every row's
    attention and bookkeeping: plain passes come out priced high and drafted ones low, and
    drafting looks better than plain decoding where it runs worse. Keyed by rows and
    tokens, the search would pick the token counts whose few samples happened to run
    fast. One cell per row count and kind prices both kinds of pass closely. The cost
    model's own prices carry how a pass grows with its tokens. A size without rows
    (``factor(rows)`` of batched sub-network steps) is one number.

    A median, not an average: the first pass at a new row count can run several times
    slower than the next (buffers of a new size), and a virtual machine's hiccups come in
    bursts. An exponential average seeded by that first pass prices every later plain pass
    of that row count far too high for good (the policy then always drafts at that row
    count, so no plain pass ever corrects it), and drafting loses throughput there.

    The one price this cannot learn is that of a pass never run: a plain pass (every row
    one token) of a row count the policy has only drafted at borrows the ratio of drafted
    passes, which can over-price it, so drafting keeps winning on paper.
    :attr:`plain_passes` counts the plain passes per row count, and the policy runs one
    where fewer than :data:`PLAIN_SAMPLES` have run.

    The measurements behind each of these choices: ``results/engine/HISTORY.md``,
    "Figures behind docstrings".

    Attributes:
        window: ratios per size the median is taken over (at least 1).
        ratios: size (a number, or a verification cell ``(rows, drafted)``) -> the
            median measured / predicted seconds.
        plain_passes: row count -> plain passes seen.
    """

    window: int = attrs.field(default=9)
    ratios: dict[PassSize, float] = attrs.field(factory=dict)
    plain_passes: dict[int, int] = attrs.field(factory=dict)
    _recent: dict[PassSize, deque[float]] = attrs.field(factory=dict, init=False, repr=False)
    # factor() of sizes not seen: the nearest seen size, until a new size is seen.
    _nearest: dict[PassSize, PassSize] = attrs.field(factory=dict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def observe(
        self, tokens: int, predicted: float, seconds: float, rows: int | None = None
    ) -> None:
        """Fold one pass of ``tokens`` total tokens (over ``rows`` rows, where given) into
        its size's median (ignored when either time is not positive: nothing to learn)."""
        if tokens < 1 or predicted <= 0 or seconds <= 0 or (rows is not None and rows < 1):
            return
        size = _size(tokens, rows)
        if size not in self._recent:
            self._nearest.clear()
        recent = self._recent.setdefault(size, deque(maxlen=self.window))
        recent.append(seconds / predicted)
        self.ratios[size] = statistics.median(recent)

    def observe_plain(self, rows: int) -> None:
        """Count a plain pass (one token a row) of ``rows`` rows."""
        self.plain_passes[rows] = self.plain_passes.get(rows, 0) + 1

    def plain_known(self, rows: int) -> bool:
        """Whether enough plain passes of ``rows`` rows ran to trust their price."""
        return self.plain_passes.get(rows, 0) >= PLAIN_SAMPLES

    def factor(self, tokens: int, rows: int | None = None) -> float:
        """The correction for a pass of ``tokens`` total tokens (over ``rows`` rows, where
        given): its size's, else the nearest seen size's of the same kind (1.0 before)."""
        size = _size(tokens, rows)
        ratio = self.ratios.get(size)
        if ratio is not None:
            return ratio
        nearest = self._nearest.get(size)
        if nearest is None:
            alike = [seen for seen in self.ratios if isinstance(seen, int) == (rows is None)]
            if not alike:
                return 1.0
            nearest = min(alike, key=lambda seen: (_log_distance(seen, size), seen))
            self._nearest[size] = nearest
        return self.ratios[nearest]


def _size(tokens: int, rows: int | None) -> PassSize:
    """The calibration cell of a pass: its tokens, or its rows and whether it drafted."""
    return tokens if rows is None else (rows, tokens > rows)


#: How far a plain cell is from a drafted one of the same rows, in the log distance of
#: row counts: a drafted cell borrows another row count's drafted ratio within 2x rows
#: before its own row count's plain one.
KIND_DISTANCE = math.log(2.0)


def _log_distance(a: PassSize, b: PassSize) -> float:
    """How far apart two pass sizes are: the log ratio of their counts (rows), plus
    :data:`KIND_DISTANCE` between a plain and a drafted cell."""
    if isinstance(a, int) or isinstance(b, int):
        assert isinstance(a, int) and isinstance(b, int)
        return abs(math.log(a / b))
    return abs(math.log(a[0] / b[0])) + (KIND_DISTANCE if a[1] != b[1] else 0.0)


class RoundPrices:
    """One round's calibrated prices, each cost-model query made once: the products of
    ``T`` packed tokens, one row's attention at width ``w``, one batched sub-network step
    over every row.

    Args:
        cost_model: the decoder's cost model.
        rows: the round's active rows; context: their mean committed length.
        calibration, draft_calibration: the learned corrections of batched verification
            passes and of batched sub-network steps.
        mask: the sub-network a round may run (None: no draft steps are priced).
    """

    def __init__(
        self,
        cost_model: CostModel,
        rows: int,
        context: int,
        calibration: BatchPassCalibration,
        draft_calibration: BatchPassCalibration,
        mask: SublayerMask | None,
    ) -> None:
        self.cost_model = cost_model
        self.calibration = calibration
        self.draft_calibration = draft_calibration
        self.mask = mask
        self.rows = rows
        self.context = context
        self._products: dict[int, float] = {}
        self._attention: dict[int, float] = {}
        # The calibration does not change within a round, and the search asks for the
        # same token counts thousands of times: each factor is looked up once a round.
        self._factors: dict[int, float] = {}
        self._step: float | None = None
        # The same prices as arrays, for pricing many candidates at once (:meth:`rounds`).
        self._product_table: FloatArray = np.zeros(1)
        self._factor_table: FloatArray = np.ones(1)
        self._attention_table: FloatArray = np.zeros(1)

    def attention(self, width: int) -> float:
        """One row's attention seconds at ``width`` new tokens (uncalibrated)."""
        seconds = self._attention.get(width)
        if seconds is None:
            seconds = row_attention_cost(self.cost_model, width, self.context)
            self._attention[width] = seconds
        return seconds

    def attention_table(self, widest: int) -> FloatArray:
        """``table[w]`` = :meth:`attention` ``(w)`` for ``w = 0 .. widest`` at least
        (``table[0]`` unused, 0); kept for the round and grown as asked."""
        if len(self._attention_table) <= widest:
            self._attention_table = np.array(
                [0.0, *(self.attention(w) for w in range(1, widest + 1))]
            )
        return self._attention_table

    def _token_tables(self, top: int) -> tuple[FloatArray, FloatArray]:
        """Products' seconds and calibration factors by total tokens ``0 .. top`` at least
        (index 0 unused), each value made once a round (the same dicts as :meth:`round`)."""
        have = len(self._product_table)
        if have <= top:
            products, factors = [], []
            for tokens in range(have, top + 1):
                value = self._products.get(tokens)
                if value is None:
                    value = self._products[tokens] = self.cost_model.verify_cost(tokens, 0)
                products.append(value)
                factor = self._factors.get(tokens)
                if factor is None:
                    factor = self._factors[tokens] = self.calibration.factor(tokens, self.rows)
                factors.append(factor)
            self._product_table = np.concatenate((self._product_table, products))
            self._factor_table = np.concatenate((self._factor_table, factors))
        return self._product_table, self._factor_table

    def rounds(self, tokens: IntArray, widths: IntArray | int, attended: FloatArray) -> FloatArray:
        """:meth:`round` (no sub-network steps, ``attended`` given) of many candidates at
        once, element by element the same arithmetic: ``(products + attention) · factor``.
        Shapes: ``tokens`` (at least 1 each), ``attended`` and (unless an int) ``widths``
        alike."""
        products, factors = self._token_tables(int(tokens.max()))
        width = np.asarray(widths, dtype=np.int64)
        padded = self.rows * self.attention_table(int(width.max()))[width]
        splits = (self.rows > 1) & (self.rows * width >= SPLIT_PADDING_FACTOR * tokens)
        attention = np.where(splits, attended, padded)
        return (products[tokens] + attention) * factors[tokens]

    def round(self, tokens: int, width: int, steps: int, attended: float | None = None) -> float:
        """Seconds of ``steps`` sub-network steps, then a verification of ``tokens`` real
        tokens padded to ``width`` per row.

        Args:
            attended: the rows' attention seconds at their own widths,
                ``Σ_r attention(w_r)``: what the pass costs where it splits its attention
                (:func:`~knapspec.model.passes.batched.splits_attention`); None: every row at
                ``width``.
        """
        products = self._products.get(tokens)
        if products is None:
            products = self.cost_model.verify_cost(tokens, 0)
            self._products[tokens] = products
        if attended is not None and splits_attention(self.rows, width, tokens):
            attention = attended
        else:
            attention = self.rows * self.attention(width)
        factor = self._factors.get(tokens)
        if factor is None:
            factor = self._factors[tokens] = self.calibration.factor(tokens, self.rows)
        cost = (products + attention) * factor
        if steps and self.mask is not None:
            if self._step is None:
                step = batched_draft_cost(self.cost_model, self.mask, self.rows, self.context)
                self._step = step * self.draft_calibration.factor(self.rows)
            cost += steps * self._step
        return cost


__all__ = [
    "BatchPassCalibration",
    "PassSize",
    "RoundPrices",
    "batched_draft_cost",
    "batched_verify_cost",
    "packed_verify_cost",
    "row_attention_cost",
]
