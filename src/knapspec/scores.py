"""Scores of candidate hidden states against the full model's, shared by the planners' DP,
the value proxies and the bench oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mean_cosine(reference: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Mean per-token cosine similarity of each branch to the reference.

    Computed in float32 whatever the model dtype, so that low-precision models do not lose
    the small differences the DP compares. No input checks: the DP calls it at every item
    point (the proxies check their inputs first).

    Args:
        reference: ``(r, d)`` full-model states.
        candidates: ``(B, r, d)`` candidate states at the same point.

    Returns:
        ``(B,)`` in [-1, 1], float32.
    """
    similarity = F.cosine_similarity(
        candidates.float(), reference.float().unsqueeze(0).expand_as(candidates), dim=-1, eps=1e-8
    )
    return similarity.mean(dim=-1)


__all__ = ["mean_cosine"]
