"""Drafters: the proposers a speculation round can draft with, and the records they hand on.

A round drafts with one drafter, then the full model verifies. Three drafters exist:

* ``subnetwork``: the target itself with some sublayers skipped (KnapSpec's masked draft);
  its tokens come with the draft distributions ``q`` it sampled them from;
* ``lookup``: a continuation of an earlier occurrence of the context's suffix (prompt
  lookup); free to run, deterministic, so its ``q`` is one-hot;
* ``none``: no draft, a plain autoregressive step (γ = 0).

The planner prices them with the cost model and picks (drafter, γ) by one tokens-per-time
search (:mod:`knapspec.planners.selection`); the decoder runs the chosen one and verifies.
"""

from __future__ import annotations

from typing import ClassVar

from knapspec.components import Component
from knapspec.registry import Registry
from knapspec.types import LOOKUP, NO_DRAFT, SUBNETWORK, Draft, Verification


class Drafter(Component):
    """A proposer of draft tokens. Subclasses register in :data:`DRAFTERS`.

    ``reset(tokens)`` starts a generation with the prompt, ``extend(tokens)`` sees every
    committed token once (an incremental index must cost O(1) amortised per token), and
    the subclass's own ``propose`` method drafts. Both hooks default to no-ops.
    """

    #: Whether proposing is cheap enough to run every round before planning (the planner
    #: then prices the actual proposal); False for drafters run only once chosen.
    proposes_before_planning: ClassVar[bool] = False

    def reset(self, tokens: list[int]) -> None:
        """Forget the last generation; ``tokens`` is the new prompt."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed after everything seen so far."""


DRAFTERS: Registry[Drafter] = Registry("drafter")

__all__ = ["DRAFTERS", "LOOKUP", "NO_DRAFT", "SUBNETWORK", "Draft", "Drafter", "Verification"]
