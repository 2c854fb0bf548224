"""The oracle's lookup family: fixed-length prompt lookup replayed on the AR continuation
and priced with measured verify times (step 5 of :mod:`knapspec.bench.oracle`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from knapspec.drafters.base import DraftRequest


class Proposal(Protocol):
    """What a lookup drafter proposes: the draft's token ids."""

    @property
    def tokens(self) -> Sequence[int]: ...


class LookupProposer(Protocol):
    """The prompt-lookup drafter's interface the replay needs
    (:class:`knapspec.drafters.lookup.LookupDrafter` has it)."""

    def reset(self, tokens: list[int]) -> None: ...

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, request: DraftRequest) -> Proposal: ...


@attrs.frozen
class LookupCandidate:
    """Fixed-length prompt lookup with k tokens, replayed on the AR continuation.

    Attributes:
        draft_length: k.
        rounds: verify rounds of the replay; drafted, accepted: draft tokens in total.
        lookup_seconds: measured time of the replay's proposals and index updates.
        speedup: plain decoding's time for the same tokens over the replay's priced time.
    """

    draft_length: int
    rounds: int
    drafted: int
    accepted: int
    lookup_seconds: float
    speedup: float

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def lookup_replay(
    proposer: LookupProposer,
    prompt: Sequence[int],
    continuation: Sequence[int],
    draft_length: int,
) -> tuple[list[tuple[int, int]], float]:
    """Rounds of fixed-length lookup decoding that reproduce ``continuation``.

    The first continuation token comes from prefill (as in the decoder); every round then
    drafts up to ``draft_length`` tokens (never past the last token), accepts the prefix
    equal to the continuation and commits it plus the bonus token.

    Returns:
        ``([(drafted, accepted) per round], seconds spent in the proposer)``.
    """
    started = time.perf_counter()
    proposer.reset([*prompt, continuation[0]])
    rounds: list[tuple[int, int]] = []
    position, total = 1, len(continuation)
    while position < total:
        limit = min(draft_length, total - position - 1)
        draft = list(proposer.propose(DraftRequest(limit)).tokens)[:limit] if limit > 0 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == continuation[position + accepted]:
            accepted += 1
        committed = list(continuation[position : position + accepted + 1])
        proposer.extend(committed)
        rounds.append((len(draft), accepted))
        position += len(committed)
    return rounds, time.perf_counter() - started


def lookup_candidates(
    proposer_factory: Callable[[], LookupProposer],
    prompt: Sequence[int],
    continuation: Sequence[int],
    verify_seconds: Sequence[float],
) -> list[LookupCandidate]:
    """One :class:`LookupCandidate` per k = 1 .. len(verify_seconds) - 1.

    Args:
        verify_seconds: measured full-model step over ``1 .. D + 1`` tokens; a round that
            drafted d tokens costs ``verify_seconds[d]``.
    """
    plain = (len(continuation) - 1) * verify_seconds[0]
    result = []
    for k in range(1, len(verify_seconds)):
        rounds, seconds = lookup_replay(proposer_factory(), prompt, continuation, k)
        priced = sum(verify_seconds[drafted] for drafted, _ in rounds) + seconds
        result.append(
            LookupCandidate(
                draft_length=k,
                rounds=len(rounds),
                drafted=sum(d for d, _ in rounds),
                accepted=sum(a for _, a in rounds),
                lookup_seconds=seconds,
                speedup=plain / priced if priced > 0 else 1.0,
            )
        )
    return result


__all__ = ["LookupCandidate", "LookupProposer", "Proposal", "lookup_candidates", "lookup_replay"]
