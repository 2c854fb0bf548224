"""Non-negative least-squares fits of a latency profile's laws (the fitted linear model's
building blocks, :mod:`knapspec.costmodels.linear`): the per-width verify law and the
per-layer attention lines of a model with sliding-window layers.

Every coefficient of these laws is a time or a time per token, so none may be negative
(scikit-learn's ``LinearRegression(positive=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from sklearn.linear_model import LinearRegression

from knapspec.costmodels.local_layers import Windows, effective_context, mean_effective_context
from knapspec.costmodels.profile import ProfileError, VerifyTiming


def verify_features(contexts: NDArray[np.float64]) -> NDArray[np.float64]:
    """Design matrix ``(m, 2)`` of one width's verify line: ``[1, n]``."""
    return np.stack([np.ones_like(contexts), contexts], axis=1)


def nonnegative_lstsq(
    design: NDArray[np.float64], target: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Non-negative least squares: ``(p,)`` for ``target (m,)``, ``(p, t)`` for ``(m, t)``.

    Every coefficient of these laws is a time or a time per token, so none may be
    negative: on a noisy machine unconstrained least squares can fit attention that gets
    *faster* with context, which would give absurd knapsack weights at long context.
    """
    if target.ndim == 1:
        return nonnegative_lstsq(design, target[:, None])[:, 0]
    regression = LinearRegression(fit_intercept=False, positive=True)
    columns = [regression.fit(design, column).coef_.copy() for column in target.T]
    return np.stack(columns, axis=1).astype(np.float64)


def fit_verify_law(
    timings: Sequence[VerifyTiming], windows: Windows = ()
) -> tuple[NDArray[np.float64], tuple[int, ...]]:
    """Per-width verify lines ``t_verify(k, n) = A_k + B_k·n`` from measured forwards.

    * A width measured at >= 2 contexts gets its own non-negative least-squares line.
    * A width measured at one context only keeps its measured time there and borrows the
      slope ``B`` of the widths that have lines (linearly interpolated in ``k``, the
      nearest one beyond them): attention over the context grows with ``k`` too, so a slope
      of 0 would misprice it at every other context. The slope is lowered where needed to
      keep ``A_k >= 0``.
    * A width between two measured widths is interpolated linearly in ``k`` (each
      coefficient, so each prediction lies between its neighbours' at every context).
    * A width below the narrowest measured one gets that width's line: the cost does not
      fall with ``k``, so this is an upper bound (profiles always measure ``k = 1``).

    Args:
        timings: the profile's verification forwards (any order, repeats allowed).
        windows: the profile's sliding windows: ``n`` is then the layers' mean effective
            context (:func:`~knapspec.costmodels.local_layers.mean_effective_context`).

    Returns:
        ``table`` ``(K, 2)`` with row ``k - 1 = (A_k, B_k)`` for ``k = 1..K``, ``K`` the
        widest measured width (wider: :func:`verify_line`), and the measured widths.

    Raises:
        ProfileError: fewer than two widths, or no width measured at two contexts.
    """
    by_width: dict[int, list[tuple[float, float]]] = {}
    for timing in timings:
        context = mean_effective_context(timing.context_length, windows)
        by_width.setdefault(int(timing.tokens), []).append((float(context), float(timing.seconds)))
    widths = sorted(by_width)
    contexts_of = {k: {n for n, _ in by_width[k]} for k in widths}
    if len(widths) < 2:
        raise ProfileError(
            "fitting t_verify(k, n) needs verification timings at >= 2 token counts; the "
            f"profile has k in {widths}"
        )
    lined = [k for k in widths if len(contexts_of[k]) >= 2]
    if not lined:
        raise ProfileError(
            "fitting t_verify(k, n) = A_k + B_k·n needs some width k timed at >= 2 contexts; "
            "the profile has "
            + ", ".join(f"k={k} at n in {sorted(contexts_of[k])}" for k in widths)
        )
    lines: dict[int, tuple[float, float]] = {}
    for k in lined:
        points = np.array(by_width[k])  # (m, 2): context, seconds
        a, b = nonnegative_lstsq(verify_features(points[:, 0]), points[:, 1])
        lines[k] = (float(a), float(b))
    lined_slopes = np.array([lines[k][1] for k in lined])
    for k in widths:
        if k in lines:
            continue
        points = np.array(by_width[k])
        context, seconds = float(points[:, 0].mean()), float(points[:, 1].mean())
        slope = float(np.interp(k, lined, lined_slopes))
        if context > 0:
            slope = min(slope, seconds / context)  # A_k = seconds - slope·context >= 0
        lines[k] = (seconds - slope * context, slope)
    table = np.array([lines[k] for k in widths])  # (W, 2) at the measured widths
    every = np.arange(1, widths[-1] + 1)
    # Below the narrowest measured width np.interp holds its values: the flat rule above.
    full = np.stack([np.interp(every, widths, table[:, j]) for j in range(2)], axis=1)
    for k in widths:  # exact measured lines, not re-interpolated ones
        full[k - 1] = lines[k]
    return full.astype(np.float64), tuple(widths)


def fit_windowed_attention(
    contexts: NDArray[np.float64], attention: NDArray[np.float64], windows: Windows, pooled: bool
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per-layer ``(a_i, b_i)`` of ``t_attn(n, i) = a_i + b_i·min(n, W_i)``, each ``(L,)``.

    Args:
        contexts: ``(C,)`` the item ladder; attention: ``(L, C)`` its timings.
        windows: ``(L,)`` per layer its window or None (non-empty).
        pooled: one line through every layer's points, each at its effective contexts.

    A layer whose window leaves fewer than two distinct effective contexts on the ladder
    (the window at or below the shortest context) cannot identify a slope: it keeps its
    mean time at the window and borrows the mean slope of the layers that have lines
    (lowered where needed to keep ``a_i >= 0``), as a verify width timed at one context does.
    """
    layers = attention.shape[0]
    effective = np.array(  # (L, C): the context each layer's attention paid for
        [[effective_context(int(n), w) for n in contexts] for w in windows], dtype=np.float64
    )
    if pooled:
        design = np.concatenate([np.stack([np.ones_like(row), row], axis=1) for row in effective])
        coef = nonnegative_lstsq(design, attention.reshape(-1))
        return np.full(layers, coef[0]), np.full(layers, coef[1])
    intercept, slope = np.zeros(layers), np.zeros(layers)
    lone: list[int] = []
    for window in dict.fromkeys(windows):  # each distinct window once, in layer order
        group = [i for i in range(layers) if windows[i] == window]
        row = effective[group[0]]
        if len(np.unique(row)) < 2:
            lone += group
            continue
        coef = nonnegative_lstsq(np.stack([np.ones_like(row), row], axis=1), attention[group].T)
        intercept[group], slope[group] = coef[0], coef[1]
    lined = [i for i in range(layers) if i not in lone]
    borrowed = float(slope[lined].mean()) if lined else 0.0
    for i in lone:
        context, seconds = float(effective[i].mean()), float(attention[i].mean())
        slope[i] = min(borrowed, seconds / context)
        intercept[i] = seconds - slope[i] * context
    return intercept, slope


__all__ = ["fit_verify_law", "fit_windowed_attention", "nonnegative_lstsq", "verify_features"]
