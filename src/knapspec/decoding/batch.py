"""``generate_batch``: a fixed list of requests decoded through the batch loop.

:func:`decode_requests` is a short driver over
:class:`~knapspec.decoding.continuous.ContinuousBatch` (the rounds, drafts, verification,
admission and retirement live there and in :mod:`knapspec.decoding.batch_round`): it
builds a batch for the call (:data:`~knapspec.decoding.continuous.ONE_CALL`: a lane per
request, so each request drafts with fresh drafter copies and starts from fresh
acceptance estimates; the cache sized for the call's longest request; non-finite logits
fail the call), adds the requests in input order while slots are free, steps until every
row has stopped, and gathers the rows into a :class:`BatchGenerationResult`.

With fewer slots than requests (``generate_batch(..., max_batch_rows=S)``) the rest wait
in input order and a finished row's slot goes to the next one, prefilled between two
rounds (continuous batching), so a batch does not idle behind its slowest row while
prompts wait. The batch's shared sub-network is planned on the call's first request.

Greedy rows equal their prompt decoded alone; sampled rows use their own seed
(:class:`~knapspec.decoding.sampler.TokenSampler`), and under position-keyed sampling
(the default) equal their prompt decoded alone with that seed too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.decoding.continuous import ONE_CALL, ContinuousBatch, SubnetworkPlanner
from knapspec.decoding.stats import GenerationStats
from knapspec.request import Request

if TYPE_CHECKING:
    from knapspec.decoding.prefix_cache import PrefixCache
    from knapspec.drafters.base import Drafter
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.batch.policy import BatchDraftPolicy


@attrs.frozen
class BatchGenerationResult:
    """Output of a batched :meth:`~knapspec.SpeculativeDecoder.generate`.

    Attributes:
        tokens: per row, ``(new_r,)`` generated token ids.
        sequences: per row, ``(1, prompt_r + new_r)`` prompt and generated ids (unpadded).
        stats: per row, its counters; ``stop_reason`` is ``"eos"`` or ``"max_new_tokens"``;
            ``wall_time_s`` runs from the call's start to the row's last token, and the
            batch's verify time is charged to every row it verified.
        wall_time_s: the whole call.
    """

    tokens: list[torch.Tensor]
    sequences: list[torch.Tensor]
    stats: list[GenerationStats]
    wall_time_s: float

    @property
    def stop_reasons(self) -> list[str]:
        """Per row, why it stopped."""
        return [stats.stop_reason for stats in self.stats]

    @property
    def new_tokens(self) -> int:
        """New tokens over all rows."""
        return sum(stats.new_tokens for stats in self.stats)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over all rows per second of the call (throughput)."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def padded_sequences(self, pad_token_id: int) -> torch.Tensor:
        """``(B, max_len)`` sequences right-padded with ``pad_token_id``."""
        width = max(seq.shape[1] for seq in self.sequences)
        out = torch.full((len(self.sequences), width), pad_token_id, dtype=torch.long)
        for row, seq in enumerate(self.sequences):
            out[row, : seq.shape[1]] = seq[0]
        return out


def decode_requests(
    engine: SublayerEngine,
    scratch: KVCache,
    requests: list[Request],
    *,
    policy: BatchDraftPolicy,
    max_draft_length: int,
    drafters: Mapping[str, Drafter],
    proposers: Iterable[str] = (),
    plan_subnetwork: SubnetworkPlanner | None = None,
    capture_points: bool = False,
    slots: int | None = None,
    prefix_cache: PrefixCache | None = None,
) -> BatchGenerationResult:
    """Decode ``requests`` (at least one) as one batch; results in their order.

    Args:
        engine, scratch, policy, max_draft_length, drafters, proposers, plan_subnetwork,
            capture_points, prefix_cache: as
            :class:`~knapspec.decoding.continuous.ContinuousBatch`.
        requests: per row, what it decodes (prompt, ``max_new_tokens``, sampling, stop
            ids, seed).
        slots: rows decoded at once (None: all; at most ``len(requests)``).

    Raises:
        NonFiniteLogitsError: a prefill's or a round's logits were not finite.
    """
    count = len(requests)
    longest = max(request.prompt_tokens + request.max_new_tokens for request in requests)
    batch = ContinuousBatch(
        engine,
        scratch,
        lanes=count,
        slots=count if slots is None else max(1, min(slots, count)),
        capacity=longest + max_draft_length,
        policy=policy,
        max_draft_length=max_draft_length,
        drafters=drafters,
        proposers=proposers,
        plan_subnetwork=plan_subnetwork,
        capture_points=capture_points,
        prefix_cache=prefix_cache,
        lock=None,  # the caller holds the decoder's lock for the whole call
        mode=ONE_CALL,
    )
    waiting = deque(requests)
    while True:
        while waiting and batch.free_lanes:
            batch.add(waiting.popleft())
        if not batch.active:
            break
        batch.step()
    wall = batch.elapsed()
    rows = [batch.rows[lane] for lane in range(count)]  # lane r holds request r
    for row in rows:
        row.stats.new_tokens = len(row.output)
    tokens = [torch.tensor(row.output, dtype=torch.long) for row in rows]
    sequences = [
        torch.cat([row.request.prompt, t]).unsqueeze(0) for row, t in zip(rows, tokens, strict=True)
    ]
    return BatchGenerationResult(tokens, sequences, [row.stats for row in rows], wall)


__all__ = ["BatchGenerationResult", "decode_requests"]
