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

from typing import ClassVar, Final

import attrs
import torch

from knapspec.components import Component
from knapspec.registry import Registry

#: Name of the γ = 0 option (a plain step) wherever drafters are named: stats, plans.
NO_DRAFT: Final = "none"
SUBNETWORK: Final = "subnetwork"
LOOKUP: Final = "lookup"


@attrs.frozen
class Draft:
    """Tokens one drafter proposed for one round.

    Attributes:
        tokens: the draft token ids, in order (may be empty: nothing to propose).
        drafter: the registered name of the drafter that produced it.
        probs: ``(len(tokens), vocab)`` the draft distributions ``q_j`` the tokens were
            sampled from, for rejection sampling; None for a deterministic draft (lookup),
            whose ``q`` is one-hot (:meth:`draft_probs` builds it).
        support: per token, the fraction of the matched earlier occurrences that continue
            with it (lookup only; 1.0 when one occurrence or all agree).
        match_length: tokens of the context's suffix the lookup matched (0 otherwise).
        predicted_acceptance: the planner's per-token acceptance estimate for the tokens it
            kept (None when not priced).
        seconds: wall time spent producing the draft.
    """

    tokens: tuple[int, ...]
    drafter: str
    probs: torch.Tensor | None = None
    support: tuple[float, ...] = ()
    match_length: int = 0
    predicted_acceptance: float | None = None
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, length: int) -> Draft:
        """The first ``length`` tokens (and their distributions / support)."""
        if length >= len(self.tokens):
            return self
        probs = self.probs[:length] if self.probs is not None else None
        return attrs.evolve(
            self, tokens=self.tokens[:length], probs=probs, support=self.support[:length]
        )

    def draft_probs(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(len(tokens), vocab_size)`` draft distributions: the stored ``q`` or, for a
        deterministic draft, one-hot rows (accepting ``x`` with probability ``p(x)`` and
        resampling from ``p`` without ``x`` on rejection is then exact)."""
        if self.probs is not None:
            return self.probs
        one_hot = torch.zeros(len(self.tokens), vocab_size, device=device)
        if self.tokens:
            index = torch.tensor(self.tokens, device=device)
            one_hot[torch.arange(len(self.tokens), device=device), index] = 1.0
        return one_hot


@attrs.frozen
class Verification:
    """What one verify pass decided.

    Attributes:
        accepted: leading draft tokens accepted.
        tokens: committed tokens: the accepted drafts, then one token from the target.
        seconds: wall time of the full-model pass and the acceptance test.
        points: ``(2L + 1, k + 1, d_model)`` captured hidden states (None unless captured).
        target_next: ``(k + 1,)`` the target's argmax after each input (None unless
            captured).
    """

    accepted: int
    tokens: list[int]
    seconds: float
    points: torch.Tensor | None = None
    target_next: torch.Tensor | None = None


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
