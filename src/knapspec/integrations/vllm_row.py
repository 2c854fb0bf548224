"""One vLLM request in a batch row, as the proposer (:mod:`knapspec.integrations.vllm`)
knows it: its :class:`~knapspec.request.Request`, its lookup index and what it was
drafted last.

vLLM hands a proposer token ids only: it keeps each request's sampling, stop ids and
``max_tokens``, verifies the drafts and stops the row itself. So the row's request holds
what the proposer does see: the prompt (the sequence when the row first decoded here) and
the limit vLLM's model length sets (``max_model_len`` less that prompt, at least 1); its
sampling and stop ids keep their defaults, unused. Its draft room is
:func:`~knapspec.request.draft_room`, the one formula knapspec's own rows use.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from knapspec.drafters.acceptance import LookupAcceptance
from knapspec.drafters.lookup import LookupIndex
from knapspec.planners.objective import FloatArray
from knapspec.request import Request, draft_room


@attrs.define
class ProposerRow:
    """One batch row's request and what the proposer drafted for it (module docstring).

    Attributes:
        request: the request as the proposer sees it (prompt, limit).
        index: its whole sequence (``request.prompt``, then every token committed
            since), looked up for drafts.
        proposal: the proposal made at the last call (full length, before the cut).
        match_length: the proposal's match length.
        bucket: the proposal's acceptance bucket (match length and streak).
        drafted: how many of the proposal's tokens vLLM was handed (γ).
        streak: whether the last proposal matched everything committed (a copy streak).
    """

    request: Request
    index: LookupIndex
    proposal: list[int] = attrs.field(factory=list)
    match_length: int = 0
    bucket: int = 0
    drafted: int = 0
    streak: bool = False

    @classmethod
    def admit(cls, sequence: list[int], max_ngram: int, max_model_len: int) -> ProposerRow:
        """A request seen for the first time with ``sequence`` (>= 1 token) so far."""
        request = Request(sequence, max(1, max_model_len - len(sequence)))
        index = LookupIndex(max_ngram)
        index.extend(sequence)
        return cls(request, index)

    @property
    def remaining(self) -> int:
        """How many more tokens vLLM may commit to it (its request's limit less its
        output)."""
        return self.request.remaining(len(self.index) - self.request.prompt_tokens)

    def draft_room(self, max_draft_length: int, max_model_len: int) -> int:
        """The most tokens its next step may draft: the request's limit leaves room for
        the step's own token; vLLM's cache holds all of its sequence but the last
        committed token (the next step writes that one)."""
        return draft_room(max_draft_length, self.remaining, len(self.index) - 1, max_model_len)

    def extends(self, committed: list[int], tokens: Any, length: int) -> bool:
        """Whether a batch row's ``tokens[:length]`` is its known sequence plus
        ``committed`` (a full comparison: a swapped-in request may share a long
        prefix)."""
        known = len(self.index)
        if known + len(committed) != length:
            return False
        head = tokens[:known]
        tail = tokens[known:length]
        return bool([int(t) for t in tail] == committed and np.array_equal(head, self.index.tokens))

    def reach(self, acceptance: LookupAcceptance) -> FloatArray:
        """``(len(proposal),)`` the probability that each proposed token is reached."""
        if not self.proposal:
            return np.zeros(0)
        rates = acceptance.conditional(self.bucket, len(self.proposal))
        reach: FloatArray = np.cumprod(rates, dtype=np.float64)
        return reach


__all__ = ["ProposerRow"]
