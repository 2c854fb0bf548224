"""Continuous batching driven from outside: rows join and leave between rounds.

:class:`ContinuousBatch` is :class:`~knapspec.decoding.batch.BatchRun` turned inside out
for a server: instead of one call that decodes a fixed list of prompts, its owner adds a
row (:meth:`ContinuousBatch.add`: the prompt prefilled alone, its first token chosen),
runs rounds (:meth:`ContinuousBatch.step`: one batched speculative round over every active
row, each with its own draft, γ and acceptance) and cancels rows, and reads each row's new
tokens after every call. The rounds, drafts, verification and retirement are
``BatchRun``'s own, so a row keeps the batch path's exactness contract: greedy tokens equal
its prompt decoded alone, and a seeded sampled row equals the same seed alone (under the
default position-keyed verification), whatever else shares the batch.

Rows live in *lanes* ``0 .. lanes - 1`` (a lane is a ``BatchRun`` row index, reused by
the next request): per lane, its drafters (so a lookup drafter's history holds the lane's
earlier requests, as it holds earlier calls) and its acceptance estimates, which the next
request in that lane starts from. Each row has its own token limit, stop ids and sampling
parameters. A row whose logits are not finite fails alone (``"error"``); every other row
goes on.

Not thread-safe: one thread (a server's scheduler) owns a ``ContinuousBatch``; it holds
its decoder's lock during each call, so a ``generate`` on the same decoder waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.decoding.batch import BatchRun
from knapspec.decoding.sampler import TokenSampler, resolve_seed
from knapspec.decoding.stats import GenerationStats
from knapspec.model.batched import new_batch_cache
from knapspec.sampling import SamplingParams
from knapspec.validators import all_finite

if TYPE_CHECKING:
    from knapspec.decoding.batch import SubnetworkPlanner
    from knapspec.decoding.prefix_cache import PrefixCache
    from knapspec.drafters.base import Drafter
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.batch.policy import BatchDraftPolicy

#: ``stop_reason`` of a row whose owner cancelled it (a client that went away).
CANCELLED = "cancelled"
#: ``stop_reason`` of a row whose logits were not finite (it fails alone).
FAILED = "error"


@attrs.frozen
class RowRequest:
    """What one row decodes.

    Attributes:
        prompt: token ids (at least one).
        max_new_tokens: the row's token limit (>= 1).
        stop_ids: token ids that end the row (kept in its output).
        sampling: how the row picks tokens (greedy unless ``do_sample``).
        seed: the row's sampling seed (None: ``sampling.seed``, else a fresh one).
    """

    prompt: Sequence[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int | None = None


@attrs.frozen
class RowUpdate:
    """What a row did in the last :meth:`ContinuousBatch.add` or :meth:`~ContinuousBatch.step`.

    Attributes:
        lane: the row's lane.
        tokens: its newly committed token ids (possibly none).
        stop_reason: ``""`` while it runs; else ``"eos"``, ``"max_new_tokens"``,
            ``"cancelled"`` or ``"error"`` (it has left the batch).
        stats: its counters so far (prompt tokens, cached prompt tokens, rounds, ...).
    """

    lane: int
    tokens: list[int]
    stop_reason: str
    stats: GenerationStats


class ContinuousBatch(BatchRun):
    """A batch whose rows are added and cancelled between rounds (module docstring).

    Built by :meth:`knapspec.SpeculativeDecoder.continuous_batch`, which passes its
    engine, caches, drafters and batch policy.

    Args:
        lanes: rows decoded at once (>= 1).
        capacity: token slots per row: a row's prompt + ``max_new_tokens`` + the largest
            draft must fit (the batch K/V cache holds ``lanes × capacity`` tokens).
        lock: held during every call (the decoder's).
        Others: as :class:`BatchRun`.
    """

    def __init__(
        self,
        engine: SublayerEngine,
        scratch: KVCache,
        *,
        lanes: int,
        capacity: int,
        policy: BatchDraftPolicy,
        max_draft_length: int,
        drafters: dict[str, Drafter],
        proposers: Sequence[str],
        plan_subnetwork: SubnetworkPlanner | None,
        capture_points: bool,
        prefix_cache: PrefixCache | None,
        lock: threading.Lock,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        capacity = min(capacity, engine.max_context)
        if capacity <= max_draft_length + 1:
            raise ValueError(
                f"capacity {capacity} leaves no room for a prompt and its drafts "
                f"(max_draft_length {max_draft_length})"
            )
        placeholder = torch.zeros(1, dtype=torch.long)
        greedy = SamplingParams()
        super().__init__(
            engine,
            scratch,
            [placeholder] * lanes,
            max_new_tokens=1,
            stop_ids=frozenset(),
            params=greedy,
            policy=policy,
            max_draft_length=max_draft_length,
            drafters=drafters,
            proposers=proposers,
            samplers=[TokenSampler(greedy, 0, engine.device) for _ in range(lanes)],
            plan_subnetwork=plan_subnetwork,
            capture_points=capture_points,
            slots=lanes,
            prefix_cache=prefix_cache,
        )
        self.lanes = lanes
        self.capacity = capacity
        self._lock = lock
        self._limits = [1] * lanes
        self._row_stops = [frozenset[int]()] * lanes
        self._cache = new_batch_cache(engine, lanes, capacity)
        self._cache.keep([])
        self.policy.reset(lanes)
        self.policy.use_subnetwork(None)
        self._active: list[int] = []  # lanes, in cache order
        self._free = list(range(lanes))
        self._pending = [0] * lanes
        self._lengths = [0] * lanes
        self._reported = [0] * lanes
        self._start = time.perf_counter()

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> list[int]:
        """Lanes decoding now, in batch order."""
        return list(self._active)

    @property
    def free_lanes(self) -> int:
        """How many rows :meth:`add` can take now."""
        return len(self._free)

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a row with ``prompt_tokens`` prompt tokens may ask for."""
        return self.capacity - prompt_tokens - self.max_draft_length - 1

    # ------------------------------------------------------------------ calls
    def add(self, request: RowRequest) -> RowUpdate:
        """Prefill ``request``'s prompt alone, give it a lane and commit its first token.

        Raises:
            RuntimeError: no free lane.
            ValueError: an empty prompt, a limit below 1, or no room for prompt + limit.
            NonFiniteLogitsError: the prefill's logits were not finite (the row is not
                added; the batch is unharmed).
        """
        if not self._free:
            raise RuntimeError("no free lane: every row of the batch is decoding")
        prompt = torch.tensor(list(request.prompt), dtype=torch.long)
        if prompt.numel() < 1:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.max_new_tokens > self.room(prompt.numel()):
            raise ValueError(
                f"{prompt.numel()} prompt tokens + {request.max_new_tokens} new tokens do not "
                f"fit a row of {self.capacity} tokens (draft room {self.max_draft_length})"
            )
        lane = self._free[0]
        seed = request.seed % 2**64 if request.seed is not None else resolve_seed(request.sampling)
        self.prompts[lane] = prompt
        self.samplers[lane] = TokenSampler(request.sampling, seed, self.engine.device)
        self.stats[lane] = GenerationStats(prompt_tokens=prompt.numel())
        self.outputs[lane] = []
        self._limits[lane] = request.max_new_tokens
        self._row_stops[lane] = request.stop_ids
        self._lengths[lane] = prompt.numel()
        self._reported[lane] = 0
        with self._lock, torch.inference_mode():
            self._admit(lane, self._cache, self._active, self._pending)
        self._free.remove(lane)
        # The sub-network is planned once, on the first row ever admitted (BatchRun plans
        # on row 0 of each call; here lane 0 returns with every later request).
        self.plan_subnetwork = None
        update = self._update(lane)
        self._retire_stopped()  # a row may stop on its first token
        return update

    def cancel(self, lane: int) -> None:
        """Stop ``lane``'s row; it leaves the batch before the next round."""
        if lane in self._active and not self.stats[lane].stop_reason:
            self.stats[lane].stop_reason = CANCELLED
        self._retire_stopped()

    def step(self) -> list[RowUpdate]:
        """One batched round over the active rows; per row, what it committed. Rows that
        stopped (their limit, a stop id, non-finite logits) have left the batch after it."""
        self._retire_stopped()
        rows = list(self._active)
        if not rows:
            return []
        with self._lock, torch.inference_mode():
            self._round(self._active, self._cache, self._pending, self._lengths)
        updates = [self._update(lane) for lane in rows]
        self._retire_stopped()
        return updates

    # ------------------------------------------------------------------ BatchRun hooks
    def _token_limit(self, row: int) -> int:
        return self._limits[row]

    def _stop_ids(self, row: int) -> frozenset[int]:
        return self._row_stops[row]

    def _failed_rows(self, active: list[int], logits: torch.Tensor, widths: list[int]) -> set[int]:
        """Rows whose verification logits are not finite stop with ``"error"``; the others
        commit as usual (a row's logits depend on its own tokens and K/V only)."""
        # Usually all finite: one reduction first (the element-wise mask below had cost
        # 1.9 ms of a 16-row round's 46).
        if all_finite(logits):
            return set()
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        failed: set[int] = set()
        offset = 0
        for slot, width in enumerate(widths):
            if not all(finite[offset : offset + width]):
                failed.add(slot)
                self.stats[active[slot]].stop_reason = FAILED
            offset += width
        return failed

    # ------------------------------------------------------------------ helpers
    def _update(self, lane: int) -> RowUpdate:
        output = self.outputs[lane]
        new = output[self._reported[lane] :]
        self._reported[lane] = len(output)
        stats = self.stats[lane]
        stats.new_tokens = len(output)
        return RowUpdate(lane, list(new), stats.stop_reason, stats)

    def _retire_stopped(self) -> None:
        stopped = [lane for lane in self._active if self.stats[lane].stop_reason]
        if not stopped:
            return
        self._retire(self._active, self._cache, self._start)
        self._free.extend(stopped)
        self._free.sort()


__all__ = ["CANCELLED", "FAILED", "ContinuousBatch", "RowRequest", "RowUpdate"]
