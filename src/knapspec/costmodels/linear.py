"""The fitted linear-in-context cost model (method spec §2, with a measured verify cost).

From a :class:`~knapspec.costmodels.profile.LatencyProfile`, by non-negative least squares
(scikit-learn's ``LinearRegression(positive=True)``; every coefficient is a time):

* ``t_attn(n, i) = a_i + b_i·n`` per layer ``i`` (or one pooled ``a + b·n``);
* ``t_mlp(i) = c_i``, the median over the ladder (or the pooled median);
* ``overhead = o``, the median step time with no item;
* ``t_verify(k, n) = A_k + B_k·n`` for a full forward over ``k`` tokens: one line in the
  context per verification width ``k`` (see :func:`fit_verify_law`).

With sliding-window (local) layers (:mod:`~knapspec.costmodels.local_layers`), ``n`` is the
effective context: ``min(n, W_i)`` in layer ``i``'s attention line, the layers' mean of it
in the verify law. A model without windows is fitted and priced exactly as before.

The verify law is measured, not assumed. The paper prices verification as one target step
(``L·(t_attn + t_mlp)`` for any ``k``), which holds on a GPU but not on a CPU. Nor is the
cost linear in ``k`` there: BLAS processes the rows of the few-row linear kernel
(:mod:`knapspec.model.kernels.table`) in blocks of 4, so ``t(k)/t(1)`` at 512 tokens was measured
as a staircase (about 1.00, 1.05, 1.10, 1.10, 1.5, 1.75, 2.0, 2.0, 2.3, 2.7, 3.0 for
k = 1..11). A line in ``k`` overprices ``k <= 4`` and underprices ``k = 5..8``, which sends
the planner's tokens-per-time search to the wrong draft length; one line per width cannot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import attrs
import numpy as np
from numpy.typing import NDArray

from knapspec.costmodels.base import COST_MODELS, CostModel
from knapspec.costmodels.fitting import (
    fit_verify_law,
    fit_windowed_attention,
    nonnegative_lstsq,
    verify_features,
)
from knapspec.costmodels.local_layers import Windows, effective_context, mean_effective_context
from knapspec.costmodels.profile import LatencyProfile, ProfileError
from knapspec.costmodels.store import load_or_measure_profile
from knapspec.types import SublayerMask
from knapspec.validators import non_empty_string, optional

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

#: Smallest time any prediction may return (the knapsack weights divide by item times).
MIN_SECONDS = 1e-7


def verify_line(
    intercepts: Sequence[float], slopes: Sequence[float], tokens: int
) -> tuple[float, float]:
    """``(A_k, B_k)`` of width ``k = tokens`` from a per-width table over widths ``1..K``.

    Args:
        intercepts, slopes: ``(K,)`` ``A_1..A_K`` (seconds) and ``B_1..B_K`` (s/token).
        tokens: the width ``k >= 1``.

    Beyond the table (``k > K``) each coefficient is extrapolated with the step between the
    last two widths, never downward: ``A_k = A_K + (k-K)·max(A_K - A_{K-1}, 0)`` and the
    same for ``B``. The result is again a line in ``n``, and it lies on or above width
    ``K``'s line at every context: a wider verification never costs less than a narrower
    one, even when the last two measurements came out the wrong way round.
    """
    width = len(intercepts)
    if tokens <= width:
        return float(intercepts[tokens - 1]), float(slopes[tokens - 1])
    a, b = float(intercepts[-1]), float(slopes[-1])
    if width == 1:
        return a, b
    extra = tokens - width
    return (
        a + extra * max(a - float(intercepts[-2]), 0.0),
        b + extra * max(b - float(slopes[-2]), 0.0),
    )


def _verify_pairs(value: Any) -> tuple[tuple[float, float], ...]:
    pairs = tuple((float(a), float(b)) for a, b in value)
    if not pairs:
        raise ValueError("verify needs the line of at least width 1")
    return pairs


@attrs.frozen
class LinearCoefficients:
    """The pooled (layer-averaged) coefficients of a linear cost model, in seconds.

    Attributes:
        overhead: per-step time with no item.
        attn_intercept, attn_slope: ``t_attn(n) = attn_intercept + attn_slope·n``.
        mlp: ``t_mlp``.
        verify: ``K`` pairs ``(A_k, B_k)`` for widths ``k = 1..K``:
            ``t_verify(k, n) = A_k + B_k·n`` (wider widths: :func:`verify_line`).
    """

    overhead: float
    attn_intercept: float
    attn_slope: float
    mlp: float
    verify: tuple[tuple[float, float], ...] = attrs.field(converter=_verify_pairs)

    @property
    def max_width(self) -> int:
        """``K``, the widest verification with its own line."""
        return len(self.verify)

    def verify_seconds(self, tokens: int, context_length: int) -> float:
        """``t_verify(tokens, context_length)`` of this law (no floor)."""
        if tokens < 1:
            raise ValueError(f"verification needs tokens >= 1, got {tokens}")
        intercepts = [a for a, _ in self.verify]
        slopes = [b for _, b in self.verify]
        a, b = verify_line(intercepts, slopes, tokens)
        return a + b * context_length

    def as_array(self) -> NDArray[np.float64]:
        """``(4 + 2K,)``: overhead, attn_intercept, attn_slope, mlp, A_1, B_1, ..., A_K, B_K."""
        return np.array(
            [
                self.overhead,
                self.attn_intercept,
                self.attn_slope,
                self.mlp,
                *(x for pair in self.verify for x in pair),
            ]
        )


@attrs.frozen
class FittedLinearCostModelConfig:
    """Hyper-parameters of :class:`FittedLinearCostModel`.

    Attributes:
        profile: path of a saved profile; None = the cached profile for this model and
            machine (quick self-profiling on first use, see
            :func:`~knapspec.costmodels.store.load_or_measure_profile`).
        pooled: one attention line and one MLP time for all layers (else per layer).
        force: use a profile measured for another model or machine anyway.
    """

    profile: str | None = attrs.field(
        default=None,
        validator=optional(non_empty_string),
    )
    pooled: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    force: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@COST_MODELS.register("linear")
class FittedLinearCostModel(CostModel):
    """Static least-squares fit of a latency profile; ignores observations.

    Build it with :meth:`from_profile`. Arrays are per layer even when pooled (then every
    row is the same), so the prediction code has one path.

    Attributes:
        profile: the measurements it was fitted to.
        pooled: whether the layers share coefficients.
        attn_intercept, attn_slope: ``(L,)`` per-layer ``a_i``, ``b_i`` (seconds, s/token).
        mlp: ``(L,)`` per-layer MLP time.
        overhead_s: per-step overhead.
        verify_coef: ``(K, 2)`` row ``k - 1 = (A_k, B_k)``: ``t_verify(k, n) = A_k + B_k·n``
            for widths ``k = 1..K`` (wider: :func:`verify_line`).
        verify_intercept, verify_slope: ``(K,)`` views of its columns.
        verify_widths: the widths that were measured (the others are interpolated).
        windows: the profile's sliding windows (``()``: none); with them ``n`` in the
            laws above is the effective context (:meth:`attention_context`,
            :meth:`mean_attention_context`).
        item_floor: no item is predicted faster than this (half the fastest measured item),
            so a line fitted to noisy points cannot drive a knapsack weight to infinity.
    """

    config_class = FittedLinearCostModelConfig

    def __init__(
        self,
        profile: LatencyProfile,
        *,
        attn_intercept: NDArray[np.float64],
        attn_slope: NDArray[np.float64],
        mlp: NDArray[np.float64],
        overhead: float,
        verify_coef: NDArray[np.float64],
        pooled: bool,
        item_floor: float = MIN_SECONDS,
        verify_widths: Sequence[int] | None = None,
    ) -> None:
        verify_coef = np.asarray(verify_coef, dtype=np.float64)
        if verify_coef.ndim != 2 or verify_coef.shape[1] != 2 or len(verify_coef) < 1:
            raise ValueError(
                f"verify_coef must be (K, 2) rows (A_k, B_k) for widths 1..K, got shape "
                f"{verify_coef.shape}"
            )
        self.config = FittedLinearCostModelConfig(pooled=pooled)
        self.profile = profile
        self.pooled = pooled
        self.attn_intercept = attn_intercept
        self.attn_slope = attn_slope
        self.mlp = mlp
        self.overhead_s = overhead
        self.verify_coef = verify_coef
        self.verify_intercept = verify_coef[:, 0]
        self.verify_slope = verify_coef[:, 1]
        self.verify_widths = tuple(
            range(1, len(verify_coef) + 1) if verify_widths is None else verify_widths
        )
        # Plain floats for the planner's per-round verify_cost(k, n) for k = 1..D+1.
        self._verify_a = [float(a) for a in self.verify_intercept]
        self._verify_b = [float(b) for b in self.verify_slope]
        self.num_layers = len(mlp)
        self.windows: Windows = profile.windows
        self.item_floor = max(item_floor, MIN_SECONDS)
        # Plain floats: a draft step's cost is then O(L) arithmetic with no numpy calls.
        self._items = [
            (float(a), float(b), float(c))
            for a, b, c in zip(attn_intercept, attn_slope, mlp, strict=True)
        ]
        self._layer_windows = self.windows or (None,) * self.num_layers
        self._mean_attn_intercept = float(attn_intercept.mean())
        self._mean_attn_slope = float(attn_slope.mean())
        self._mean_mlp = float(mlp.mean())

    # ------------------------------------------------------------------ building
    @classmethod
    def from_profile(cls, profile: LatencyProfile, *, pooled: bool = False) -> Self:
        """Least-squares fit of ``profile`` (see the module docstring for the laws).

        Raises:
            ProfileError: the profile cannot identify the coefficients (fewer than two
                item contexts, fewer than two verify widths, or no verify width timed at
                two contexts; see :func:`fit_verify_law`).
        """
        contexts = np.asarray(profile.contexts, dtype=np.float64)
        if len(contexts) < 2:
            raise ProfileError(
                f"fitting t_attn(n) = a + b·n needs item timings at >= 2 contexts, the profile "
                f"has {len(contexts)}"
            )
        attention = np.asarray(profile.attention_seconds, dtype=np.float64)  # (L, C)
        mlp_table = np.asarray(profile.mlp_seconds, dtype=np.float64)  # (L, C)
        layers = attention.shape[0]
        design = np.stack([np.ones_like(contexts), contexts], axis=1)  # (C, 2)
        if profile.windows:  # local layers: lines in min(n, W_i) (fitting.py)
            intercept, slope = fit_windowed_attention(contexts, attention, profile.windows, pooled)
        elif pooled:
            # One line through every layer's points: stacking the layers' rows is the same
            # least-squares problem as fitting the layer-mean curve.
            coef = nonnegative_lstsq(np.tile(design, (layers, 1)), attention.reshape(-1))
            intercept = np.full(layers, coef[0])
            slope = np.full(layers, coef[1])
        else:
            coef = nonnegative_lstsq(design, attention.T)  # (2, L): one column per layer
            intercept, slope = coef[0].copy(), coef[1].copy()
        if pooled:
            mlp = np.full(layers, float(np.median(mlp_table)))
        else:
            mlp = np.median(mlp_table, axis=1)

        verify_coef, verify_widths = fit_verify_law(profile.verify, profile.windows)
        overhead = float(np.median(profile.overhead_seconds))
        item_floor = 0.5 * float(min(attention.min(), mlp_table.min()))
        return cls(
            profile,
            attn_intercept=intercept,
            attn_slope=slope,
            mlp=mlp,
            overhead=overhead,
            verify_coef=verify_coef,
            pooled=pooled,
            item_floor=item_floor,
            verify_widths=verify_widths,
        )

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        profile = load_or_measure_profile(engine, config.profile, force=config.force)
        return cls.from_profile(profile, pooled=config.pooled)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        engine: SublayerEngine | None = None,
        *,
        pooled: bool = False,
        force: bool = False,
    ) -> FittedLinearCostModel:
        """Load a saved profile (checked against ``engine`` when given) and fit it."""
        profile = LatencyProfile.load(path)
        if engine is not None:
            profile.check_compatible(engine, force=force)
        return cls.from_profile(profile, pooled=pooled)

    # --------------------------------------------------------------- predictions
    def attention_context(self, context_length: int, layer: int) -> int:
        """The context layer ``layer``'s attention pays for: ``min(n, W)``, or ``n``."""
        return effective_context(context_length, self._layer_windows[layer])

    def mean_attention_context(self, context_length: int) -> float:
        """The layers' mean effective context (``n`` without windows): the ``n`` of the
        verify law and of the layer-mean ``t_attn``."""
        return mean_effective_context(context_length, self.windows)

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        if layer is not None:
            context = self.attention_context(context_length, layer)
            value = float(self.attn_intercept[layer] + self.attn_slope[layer] * context)
        elif self.windows:
            paid = sum(
                b * effective_context(context_length, w)
                for (_, b, _), w in zip(self._items, self.windows, strict=True)
            )
            value = self._mean_attn_intercept + paid / self.num_layers
        else:
            value = self._mean_attn_intercept + self._mean_attn_slope * context_length
        return max(value, self.item_floor)

    def t_mlp(self, layer: int | None = None) -> float:
        value = self._mean_mlp if layer is None else float(self.mlp[layer])
        return max(value, self.item_floor)

    def overhead(self, context_length: int) -> float:
        return max(self.overhead_s, 0.0)

    def verify_cost(self, tokens: int, context_length: int) -> float:
        if tokens < 1:
            raise ValueError(f"verification needs tokens >= 1, got {tokens}")
        a, b = verify_line(self._verify_a, self._verify_b, tokens)
        if self.windows:
            return max(a + b * self.mean_attention_context(context_length), MIN_SECONDS)
        return max(a + b * context_length, MIN_SECONDS)

    def verify_law(self, tokens: int) -> tuple[float, float]:
        """``(A_k, B_k)`` of ``t_verify(k, n) = A_k + B_k·n`` for ``k = tokens`` (seconds;
        ``n`` is :meth:`mean_attention_context`)."""
        if tokens < 1:
            raise ValueError(f"verification needs tokens >= 1, got {tokens}")
        return verify_line(self._verify_a, self._verify_b, tokens)

    def draft_cost(self, mask: SublayerMask, context_length: int) -> float:
        # Same sum as CostModel.draft_cost, without 2L method calls: the online model calls
        # this on the decode hot path for every observed draft step.
        if mask.num_layers != self.num_layers:
            raise ValueError(f"mask has {mask.num_layers} layers, the cost model {self.num_layers}")
        executed = mask.executed
        total, floor = max(self.overhead_s, 0.0), self.item_floor
        windows = self._layer_windows
        for layer, (intercept, slope, mlp) in enumerate(self._items):
            if executed[2 * layer]:
                window = windows[layer]
                context = context_length if window is None else min(context_length, window)
                total += max(intercept + slope * context, floor)
            if executed[2 * layer + 1]:
                total += max(mlp, floor)
        return total

    def coefficients(self) -> LinearCoefficients:
        """The layer-averaged coefficients (what the online model adapts; with windows the
        slopes are per token of effective context)."""
        return LinearCoefficients(
            overhead=self.overhead_s,
            attn_intercept=self._mean_attn_intercept,
            attn_slope=self._mean_attn_slope,
            mlp=self._mean_mlp,
            verify=tuple(zip(self._verify_a, self._verify_b, strict=True)),
        )

    def __repr__(self) -> str:
        c = self.coefficients()
        return (
            f"{type(self).__name__}(layers={self.num_layers}, pooled={self.pooled}, "
            f"t_attn(n)={c.attn_intercept * 1e3:.3f}ms+{c.attn_slope * 1e6:.4f}us·n, "
            f"t_mlp={c.mlp * 1e3:.3f}ms, overhead={c.overhead * 1e3:.3f}ms, "
            f"verify widths 1..{c.max_width} from measured {list(self.verify_widths)})"
        )


__all__ = [
    "MIN_SECONDS",
    "FittedLinearCostModel",
    "FittedLinearCostModelConfig",
    "LinearCoefficients",
    "fit_verify_law",
    "fit_windowed_attention",
    "verify_features",
    "verify_line",
]
