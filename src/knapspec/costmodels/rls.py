"""Exponentially weighted recursive least squares, a scikit-learn regressor: the update
rule of the online cost model (:mod:`knapspec.costmodels.online`)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_array, check_is_fitted

#: The default forgetting factor ``λ``: memory of about ``1 / (1 - λ)`` = 50 observations.
FORGETTING_FACTOR = 0.98


class RecursiveLeastSquares(BaseEstimator, RegressorMixin):  # type: ignore[misc]
    """Exponentially weighted recursive least squares, scikit-learn style.

    Minimises ``Σ_t λ^(T-t) (y_t - x_t·θ)²`` plus a ridge pull toward ``coef_init`` that
    fades with forgetting. ``partial_fit`` validates its inputs; :meth:`update` is the
    allocation-light single-sample path used on the decode hot path.

    Args:
        forgetting_factor: ``λ`` in ``(0, 1]``; 1 = ordinary (growing-memory) RLS.
        initial_covariance: ``P0 = initial_covariance · I`` (squared units of ``coef_``);
            larger means the first observations move the coefficients more.
        max_covariance_trace: cap on ``trace(P)`` (None = ``100 · trace(P0)``): high enough
            not to slow tracking, low enough to stop windup where the data never excite.
        coef_init: starting coefficients (None = zeros).

    Attributes:
        coef_: ``(n_features,)`` current coefficients.
        covariance_: ``(n_features, n_features)`` ``P``.
        n_updates_: samples absorbed.
    """

    def __init__(
        self,
        forgetting_factor: float = FORGETTING_FACTOR,
        initial_covariance: float = 100.0,
        max_covariance_trace: float | None = None,
        coef_init: ArrayLike | None = None,
    ) -> None:
        self.forgetting_factor = forgetting_factor
        self.initial_covariance = initial_covariance
        self.max_covariance_trace = max_covariance_trace
        self.coef_init = coef_init

    def initialize(self, n_features: int) -> None:
        """Start over with ``n_features`` features: coefficients ``coef_init`` (zeros when
        None) and covariance ``initial_covariance * I`` (``fit`` and ``update`` call it on
        first use; a caller seeding the estimator before any data calls it directly)."""
        if not 0.0 < self.forgetting_factor <= 1.0:
            raise ValueError(f"forgetting_factor must be in (0, 1], got {self.forgetting_factor}")
        if not self.initial_covariance > 0:
            raise ValueError(f"initial_covariance must be > 0, got {self.initial_covariance}")
        coef = (
            np.zeros(n_features)
            if self.coef_init is None
            else np.asarray(self.coef_init, dtype=np.float64).reshape(-1).copy()
        )
        if coef.shape != (n_features,):
            raise ValueError(f"coef_init has {coef.size} entries for {n_features} features")
        self.coef_: NDArray[np.float64] = coef
        self.covariance_: NDArray[np.float64] = np.eye(n_features) * self.initial_covariance
        cap = self.max_covariance_trace
        default_cap = 100.0 * n_features * self.initial_covariance
        self._trace_cap = float(default_cap if cap is None else cap)
        self.n_features_in_ = n_features
        self.n_updates_ = 0

    def update(self, x: NDArray[np.float64], y: float, max_error: float | None = None) -> None:
        """Absorb one sample ``x: (n_features,)`` with target ``y`` (no validation).

        ``max_error`` clips the prediction error before the update (a Huber-like bound on
        one sample's influence; None = plain RLS).
        """
        if not hasattr(self, "coef_"):
            self.initialize(x.shape[0])
        covariance = self.covariance_
        px = covariance @ x
        gain = px / (self.forgetting_factor + x @ px)
        error = float(y - x @ self.coef_)
        if max_error is not None:
            error = float(np.clip(error, -max_error, max_error))
        self.coef_ += gain * error
        covariance = covariance - np.outer(gain, px)
        # Symmetrise: the textbook update leaves round-off asymmetry in P, and forgetting
        # grows it by 1/λ per step; it is trace-free, so the cap never sees it. Unchecked,
        # at λ = 0.98 it swamped P after about 2000 updates and the coefficients diverged.
        covariance = (covariance + covariance.T) * (0.5 / self.forgetting_factor)
        trace = covariance.trace()
        if trace > self._trace_cap:  # bounded forgetting: no windup in unexcited directions
            covariance *= self._trace_cap / trace
        self.covariance_ = covariance
        self.n_updates_ += 1

    def forget(self, steps: int) -> None:
        """Age the state by ``steps`` sample-free steps: ``P /= λ^steps`` (trace capped).

        Exactly what ``steps`` updates with no information would do (the cap is a scalar
        rescaling, so capping once equals capping after every step). Lets a regression that
        only sees some samples forget on a shared clock (the per-width verify blocks).
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if steps == 0:
            return
        if not hasattr(self, "coef_"):
            raise ValueError("forget() needs an initialised regression (update or fit first)")
        covariance = self.covariance_
        covariance /= self.forgetting_factor**steps
        trace = covariance.trace()
        if trace > self._trace_cap:
            covariance *= self._trace_cap / trace

    def partial_fit(self, X: ArrayLike, y: ArrayLike) -> RecursiveLeastSquares:
        """Absorb samples ``X: (m, n_features)``, ``y: (m,)`` in order."""
        features = check_array(X, dtype=np.float64)
        targets = np.asarray(y, dtype=np.float64).reshape(-1)
        if targets.shape[0] != features.shape[0]:
            raise ValueError(f"X has {features.shape[0]} rows but y has {targets.shape[0]}")
        if not np.all(np.isfinite(targets)):
            raise ValueError("y holds NaN or infinite values")
        if not hasattr(self, "coef_"):
            self.initialize(features.shape[1])
        elif features.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {features.shape[1]} features, expected {self.n_features_in_}")
        for row, target in zip(features, targets, strict=True):
            self.update(row, float(target))
        return self

    def fit(self, X: ArrayLike, y: ArrayLike) -> RecursiveLeastSquares:
        """Forget everything, then :meth:`partial_fit`."""
        for name in ("coef_", "covariance_", "n_features_in_", "n_updates_"):
            self.__dict__.pop(name, None)
        return self.partial_fit(X, y)

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        """``(m,)`` predictions ``X @ coef_``."""
        check_is_fitted(self, "coef_")
        features = check_array(X, dtype=np.float64)
        return np.asarray(features @ self.coef_, dtype=np.float64)


__all__ = ["FORGETTING_FACTOR", "RecursiveLeastSquares"]
