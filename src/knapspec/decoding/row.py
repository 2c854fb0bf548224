"""One lane of decoding: a request and everything it has done so far.

A :class:`Row` is what a batch holds per lane (and what a single-sequence run holds for its
one sequence): its :class:`~knapspec.request.Request`, the sampler that picks its tokens,
its drafters, its counters, its output, the token it committed last (pending: no K/V
yet) and how many tokens its cache holds. :meth:`Row.commit` is the one place a
sequence's tokens are committed: up to its limit and its first stop token.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from knapspec.decoding.sampler import TokenSampler
from knapspec.decoding.stats import GenerationStats
from knapspec.drafters.base import Drafter
from knapspec.request import Request, draft_room

#: ``stop_reason`` of a row whose owner cancelled it (a client that went away).
CANCELLED = "cancelled"
#: ``stop_reason`` of a row whose logits were not finite (it fails alone).
FAILED = "error"


@attrs.define(eq=False)
class Row:
    """One sequence being decoded (module docstring).

    Attributes:
        request: what it decodes.
        sampler: how it picks and verifies its tokens (its seed).
        drafters: its own drafters (those that propose before every round).
        stats: its counters; ``stop_reason`` is set once it stops.
        output: its committed new tokens.
        pending: its last committed token, whose K/V is not cached yet.
        length: tokens whose K/V its cache holds (prompt + committed - the pending one).
        reported: how many of ``output`` its owner has been handed.
    """

    request: Request
    sampler: TokenSampler
    drafters: list[Drafter] = attrs.Factory(list)
    stats: GenerationStats = attrs.Factory(
        lambda self: GenerationStats(prompt_tokens=self.request.prompt_tokens), takes_self=True
    )
    output: list[int] = attrs.Factory(list)
    pending: int = 0
    length: int = attrs.Factory(lambda self: self.request.prompt_tokens, takes_self=True)
    reported: int = 0

    @property
    def remaining(self) -> int:
        """How many more tokens it may commit (its request's limit less its output)."""
        return self.request.remaining(len(self.output))

    @property
    def stopped(self) -> bool:
        """Whether it has stopped (its limit, a stop id, a cancel, an error)."""
        return bool(self.stats.stop_reason)

    def draft_room(self, max_draft_length: int, max_context: int) -> int:
        """The most tokens its next round may draft (:func:`~knapspec.request.draft_room`)."""
        return draft_room(max_draft_length, self.remaining, self.length, max_context)

    def commit(self, tokens: Sequence[int]) -> list[int]:
        """Append ``tokens`` up to its limit and its first stop token (kept); set its
        ``stop_reason`` (``"eos"``, or ``"max_new_tokens"`` at the limit). Returns the
        tokens kept."""
        stop_ids, stats = self.request.stop_ids, self.stats
        kept: list[int] = []
        for token in tokens[: self.remaining]:
            kept.append(token)
            if token in stop_ids:
                stats.stop_reason = "eos"
                break
        self.output.extend(kept)
        if not stats.stop_reason and self.remaining <= 0:
            stats.stop_reason = "max_new_tokens"
        return kept

    def unreported(self) -> list[int]:
        """The output tokens its owner has not been handed yet (now handed)."""
        new = self.output[self.reported :]
        self.reported = len(self.output)
        return new


__all__ = ["CANCELLED", "FAILED", "Row"]
