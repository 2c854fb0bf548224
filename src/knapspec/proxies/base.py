"""The value-proxy interface: how close a draft sub-network is to the full model."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.components import Component
from knapspec.registry import Registry
from knapspec.sampling import SamplingParams

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow


@attrs.frozen
class AcceptanceEstimate:
    """An estimated per-token acceptance rate α with a confidence interval."""

    alpha: float
    low: float
    high: float
    samples: int


class ValueProxy(Component, abc.ABC):
    """Scores candidate drafts against the reference window.

    ``score`` is the value a planner maximises (higher = closer to the full model), on the
    scale :attr:`score_range` declares (a planner's pruning threshold, such as the knapsack
    planner's ``tau``, is on that scale); ``estimate_acceptance`` turns a candidate into
    the α used by TPT.
    """

    @property
    def score_range(self) -> tuple[float, float]:
        """``(low, high)``: every ``score`` lies in this closed interval (bounds may be
        infinite). Default: a cosine's ``[-1, 1]``."""
        return (-1.0, 1.0)

    @abc.abstractmethod
    def score(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """Per-branch value.

        Args:
            reference: ``(r, d)`` full-model states at some item point.
            candidate: ``(B, r, d)`` candidate states at the same point.

        Returns:
            ``(B,)`` scores.
        """

    @abc.abstractmethod
    def estimate_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> list[AcceptanceEstimate]:
        """α for each candidate.

        Args:
            candidate_final: ``(B, r, d)`` each candidate's last residual state on the
                window (teacher-forced).
        """


PROXIES: Registry[ValueProxy] = Registry("value proxy")

__all__ = ["PROXIES", "AcceptanceEstimate", "ValueProxy"]
