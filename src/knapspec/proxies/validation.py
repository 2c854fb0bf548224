"""Input checks shared by the value proxies: clear errors for bad shapes, empty windows, NaN."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from knapspec.validators import check_finite

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow


def check_score_inputs(reference: torch.Tensor, candidate: torch.Tensor) -> None:
    """``reference (r, d)`` and ``candidate (B, r, d)`` with ``r, B >= 1``, finite."""
    if reference.dim() != 2:
        raise ValueError(f"reference must be (r, d), got shape {tuple(reference.shape)}")
    if candidate.dim() != 3:
        raise ValueError(f"candidate must be (branches, r, d), got shape {tuple(candidate.shape)}")
    if reference.shape[0] == 0:
        raise ValueError("the reference window is empty (r = 0 tokens)")
    if candidate.shape[0] == 0:
        raise ValueError("no candidate branches to score (B = 0)")
    if candidate.shape[1:] != reference.shape:
        raise ValueError(
            f"candidate (branches, r, d) = {tuple(candidate.shape)} does not match reference "
            f"(r, d) = {tuple(reference.shape)}"
        )
    check_finite(reference, "reference")
    check_finite(candidate, "candidate")


def check_window_inputs(
    engine: SublayerEngine, window: ReferenceWindow, candidate_final: torch.Tensor
) -> None:
    """A non-empty window and ``candidate_final (B, r, d_model)`` matching it and the model."""
    if window.size == 0:
        raise ValueError("the reference window is empty (r = 0 tokens)")
    if window.points.shape[-1] != engine.hidden_size:
        raise ValueError(
            f"window states have d_model = {window.points.shape[-1]}, the model "
            f"{engine.hidden_size}"
        )
    if window.target_tokens.shape != (window.size,):
        raise ValueError(
            f"window.target_tokens must have shape ({window.size},), got "
            f"{tuple(window.target_tokens.shape)}"
        )
    check_score_inputs(window.final_hidden, candidate_final)


__all__ = ["check_finite", "check_score_inputs", "check_window_inputs"]
