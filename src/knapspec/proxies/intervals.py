"""Confidence intervals for acceptance estimates from a window of tokens.

Both intervals treat the window's tokens as independent draws. Consecutive tokens of one
text are correlated, so the intervals are somewhat optimistic; they are meant to rank and
gate candidates, not as exact coverage statements.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from knapspec.proxies.base import AcceptanceEstimate


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> AcceptanceEstimate:
    """Proportion ``successes / trials`` with its Wilson score interval.

    The Wilson interval stays inside [0, 1] and behaves at 0 and ``trials`` successes,
    where the normal (Wald) interval collapses to a point.
    """
    if trials <= 0:
        raise ValueError(f"an acceptance estimate needs at least one token, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, {trials}], got {successes}")
    z = _z(confidence)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return AcceptanceEstimate(
        alpha=p, low=max(0.0, centre - half), high=min(1.0, centre + half), samples=trials
    )


def mean_interval(values: torch.Tensor, confidence: float = 0.95) -> AcceptanceEstimate:
    """Mean of per-token acceptance probabilities ``values (n,)`` in [0, 1], normal interval.

    Uses the sample standard deviation (``n - 1``); with one token the interval is [0, 1].
    The interval is clipped to [0, 1].
    """
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"values must be a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError("per-token acceptance values contain NaN or infinite entries")
    n = int(values.numel())
    mean = float(values.double().mean())
    if n == 1:
        return AcceptanceEstimate(alpha=mean, low=0.0, high=1.0, samples=1)
    half = _z(confidence) * float(values.double().std(unbiased=True)) / math.sqrt(n)
    return AcceptanceEstimate(
        alpha=mean, low=max(0.0, mean - half), high=min(1.0, mean + half), samples=n
    )


__all__ = ["mean_interval", "wilson_interval"]
