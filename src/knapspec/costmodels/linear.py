"""The fitted linear-in-context cost model (method spec §2, with a measured verify cost).

From a :class:`~knapspec.costmodels.profile.LatencyProfile`, by non-negative least squares
(scikit-learn's ``LinearRegression(positive=True)``; every coefficient is a time):

* ``t_attn(n, i) = a_i + b_i·n`` per layer ``i`` (or one pooled ``a + b·n``);
* ``t_mlp(i) = c_i``, the median over the ladder (or the pooled median);
* ``overhead = o``, the median step time with no item;
* ``t_verify(k, n) = v0 + v1·k + v2·n + v3·k·n`` for a full forward over ``k`` tokens.

The verify law is measured, not assumed: the paper prices verification as one target step
(``L·(t_attn + t_mlp)`` for any ``k``), which holds on a GPU but not on a CPU, where
verifying 8 tokens costs 1.6-2x one step (../shared/models.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from numpy.typing import NDArray
from sklearn.linear_model import LinearRegression

from knapspec.costmodels.base import COST_MODELS, CostModel
from knapspec.costmodels.profile import LatencyProfile, ProfileError
from knapspec.types import SublayerMask

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

#: Smallest time any prediction may return (the knapsack weights divide by item times).
MIN_SECONDS = 1e-7


@attrs.frozen
class LinearCoefficients:
    """The pooled (layer-averaged) coefficients of a linear cost model, in seconds.

    Attributes:
        overhead: per-step time with no item.
        attn_intercept, attn_slope: ``t_attn(n) = attn_intercept + attn_slope·n``.
        mlp: ``t_mlp``.
        verify: ``(v0, v1, v2, v3)`` of ``t_verify(k, n) = v0 + v1·k + v2·n + v3·k·n``.
    """

    overhead: float
    attn_intercept: float
    attn_slope: float
    mlp: float
    verify: tuple[float, float, float, float]

    def as_array(self) -> NDArray[np.float64]:
        """``(8,)``: overhead, attn_intercept, attn_slope, mlp, v0..v3."""
        return np.array(
            [self.overhead, self.attn_intercept, self.attn_slope, self.mlp, *self.verify]
        )


def verify_features(
    tokens: NDArray[np.float64], contexts: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Design matrix ``(m, 4)`` of the verify law: ``[1, k, n, k·n]``."""
    return np.stack([np.ones_like(tokens), tokens, contexts, tokens * contexts], axis=1)


def _lstsq(design: NDArray[np.float64], target: NDArray[np.float64]) -> NDArray[np.float64]:
    """Non-negative least squares: ``(p,)`` for ``target (m,)``, ``(p, t)`` for ``(m, t)``.

    Every coefficient of these laws is a time or a time per token, so none may be
    negative: on a noisy machine unconstrained least squares can fit attention that gets
    *faster* with context, which would give absurd knapsack weights at long context.
    """
    if target.ndim == 1:
        return _lstsq(design, target[:, None])[:, 0]
    regression = LinearRegression(fit_intercept=False, positive=True)
    columns = [regression.fit(design, column).coef_.copy() for column in target.T]
    return np.stack(columns, axis=1).astype(np.float64)


def _check_positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value:
        raise ValueError(f"{attribute.name} must be a non-empty path or None")


@attrs.frozen
class FittedLinearCostModelConfig:
    """Hyper-parameters of :class:`FittedLinearCostModel`.

    Attributes:
        profile: path of a saved profile; None = the cached profile for this model and
            machine (quick self-profiling on first use, see :func:`default_profile`).
        pooled: one attention line and one MLP time for all layers (else per layer).
        force: use a profile measured for another model or machine anyway.
    """

    profile: str | None = attrs.field(
        default=None,
        validator=[attrs.validators.optional(attrs.validators.instance_of(str)), _check_positive],
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
        verify_coef: ``(4,)`` ``v0..v3`` of the verify law.
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
    ) -> None:
        self.profile = profile
        self.pooled = pooled
        self.attn_intercept = attn_intercept
        self.attn_slope = attn_slope
        self.mlp = mlp
        self.overhead_s = overhead
        self.verify_coef = verify_coef
        self.num_layers = len(mlp)
        self.item_floor = max(item_floor, MIN_SECONDS)
        # Plain floats: a draft step's cost is then O(L) arithmetic with no numpy calls.
        self._items = [
            (float(a), float(b), float(c))
            for a, b, c in zip(attn_intercept, attn_slope, mlp, strict=True)
        ]
        self._mean_attn_intercept = float(attn_intercept.mean())
        self._mean_attn_slope = float(attn_slope.mean())
        self._mean_mlp = float(mlp.mean())

    # ------------------------------------------------------------------ building
    @classmethod
    def from_profile(
        cls, profile: LatencyProfile, *, pooled: bool = False
    ) -> FittedLinearCostModel:
        """Least-squares fit of ``profile`` (see the module docstring for the laws).

        Raises:
            ProfileError: the profile cannot identify the coefficients (fewer than two
                item contexts, or a verify grid without two widths and two contexts).
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
        if pooled:
            # One line through every layer's points: stacking the layers' rows is the same
            # least-squares problem as fitting the layer-mean curve.
            coef = _lstsq(np.tile(design, (layers, 1)), attention.reshape(-1))
            intercept = np.full(layers, coef[0])
            slope = np.full(layers, coef[1])
            mlp = np.full(layers, float(np.median(mlp_table)))
        else:
            coef = _lstsq(design, attention.T)  # (2, L): one column per layer
            intercept, slope = coef[0].copy(), coef[1].copy()
            mlp = np.median(mlp_table, axis=1)

        tokens = np.array([t.tokens for t in profile.verify], dtype=np.float64)
        verify_contexts = np.array([t.context_length for t in profile.verify], dtype=np.float64)
        seconds = np.array([t.seconds for t in profile.verify], dtype=np.float64)
        if len(set(tokens.tolist())) < 2 or len(set(verify_contexts.tolist())) < 2:
            raise ProfileError(
                "fitting t_verify(k, n) needs verification timings at >= 2 token counts and "
                f">= 2 contexts; the profile has k in {sorted(set(tokens.tolist()))} and n in "
                f"{sorted(set(verify_contexts.tolist()))}"
            )
        verify_coef = _lstsq(verify_features(tokens, verify_contexts), seconds)
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
        )

    @classmethod
    def from_config(cls, config: Any, engine: SublayerEngine) -> FittedLinearCostModel:
        from knapspec.costmodels.defaults import load_profile_for

        profile = load_profile_for(engine, config.profile, force=config.force)
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
    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        if layer is None:
            value = self._mean_attn_intercept + self._mean_attn_slope * context_length
        else:
            value = float(self.attn_intercept[layer] + self.attn_slope[layer] * context_length)
        return max(value, self.item_floor)

    def t_mlp(self, layer: int | None = None) -> float:
        value = self._mean_mlp if layer is None else float(self.mlp[layer])
        return max(value, self.item_floor)

    def overhead(self, context_length: int) -> float:
        return max(self.overhead_s, 0.0)

    def verify_cost(self, tokens: int, context_length: int) -> float:
        if tokens < 1:
            raise ValueError(f"verification needs tokens >= 1, got {tokens}")
        v0, v1, v2, v3 = self.verify_coef
        value = v0 + v1 * tokens + v2 * context_length + v3 * tokens * context_length
        return max(float(value), MIN_SECONDS)

    def draft_cost(self, mask: SublayerMask, context_length: int) -> float:
        # Same sum as CostModel.draft_cost, without 2L method calls: the online model calls
        # this on the decode hot path for every observed draft step.
        if mask.num_layers != self.num_layers:
            raise ValueError(f"mask has {mask.num_layers} layers, the cost model {self.num_layers}")
        executed = mask.executed
        total, floor = max(self.overhead_s, 0.0), self.item_floor
        for layer, (intercept, slope, mlp) in enumerate(self._items):
            if executed[2 * layer]:
                total += max(intercept + slope * context_length, floor)
            if executed[2 * layer + 1]:
                total += max(mlp, floor)
        return total

    def coefficients(self) -> LinearCoefficients:
        """The layer-averaged coefficients (what the online model adapts)."""
        v0, v1, v2, v3 = (float(x) for x in self.verify_coef)
        return LinearCoefficients(
            overhead=self.overhead_s,
            attn_intercept=self._mean_attn_intercept,
            attn_slope=self._mean_attn_slope,
            mlp=self._mean_mlp,
            verify=(v0, v1, v2, v3),
        )

    def __repr__(self) -> str:
        c = self.coefficients()
        return (
            f"{type(self).__name__}(layers={self.num_layers}, pooled={self.pooled}, "
            f"t_attn(n)={c.attn_intercept * 1e3:.3f}ms+{c.attn_slope * 1e6:.4f}us·n, "
            f"t_mlp={c.mlp * 1e3:.3f}ms, overhead={c.overhead * 1e3:.3f}ms)"
        )


__all__ = [
    "MIN_SECONDS",
    "FittedLinearCostModel",
    "FittedLinearCostModelConfig",
    "LinearCoefficients",
    "verify_features",
]
