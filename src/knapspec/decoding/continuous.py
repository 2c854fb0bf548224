"""The batch loop: several requests decoded at once, rows joining and leaving between rounds.

:class:`ContinuousBatch` is the one batched decoding loop. Its owner adds a row
(:meth:`ContinuousBatch.add`: the prompt prefilled alone, its first token chosen), runs
rounds (:meth:`ContinuousBatch.step`: one batched speculative round over every active
row, each with its own draft, γ and acceptance, :mod:`knapspec.decoding.batch_round`),
cancels rows, and reads each row's new tokens after every call. Two owners drive it: a
server's scheduler, whose requests arrive at any time, and ``generate_batch``
(:func:`knapspec.decoding.batch.decode_requests`), which adds a fixed list of requests in
order while slots are free. What differs between them is a :class:`BatchMode`, chosen by
the owner: whether lanes are reused, whether a non-finite verification fails one row or
the call, and whether the capacity is a fixed row size or sized for known requests.

Rows live in *lanes* ``0 .. lanes - 1``: per lane, its drafters (each drafter the planner
reads proposals of, copied per lane by ``Drafter.for_row``, the lanes' copies sharing rows
through ``Drafter.share_rows``) and the policy's acceptance estimates (the lane is the
policy's row key). At most ``slots`` rows decode at once, one per row of the batch K/V
cache. Each row has its own :class:`~knapspec.request.Request` (token limit, stop ids,
sampling parameters, seed).

A row enters through the engine's single-sequence path (compute-bound, so batching a
prefill gains nothing; the decoder's prefix cache supplies any cached prefix) and its K/V
is copied into a free slot of the batch cache. The first row admitted also plans the
batch's shared sub-network (its prefill is what the planner reads). A row that stops (a
stop id, its limit, a cancel, an error) leaves between rounds: the cache packs the
remaining rows to the front and later rounds compute only those.

Greedy rows equal their prompt decoded alone; a seeded sampled row equals the same seed
alone under the default position-keyed verification, whatever else shares the batch.

Not thread-safe: one thread owns a ``ContinuousBatch``. A server's batch holds its
decoder's lock during each call, so a ``generate`` on the same decoder waits;
``generate_batch`` holds it around its whole call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.decoding.batch_round import BatchRound
from knapspec.decoding.row import CANCELLED, FAILED, Row
from knapspec.decoding.run import PREFILL_WINDOW_TOKENS
from knapspec.decoding.sampler import TokenSampler
from knapspec.decoding.stats import GenerationStats
from knapspec.errors import NonFiniteLogitsError
from knapspec.model.passes.batched import new_batch_cache
from knapspec.planners.batch.policy import BatchSubnetwork
from knapspec.request import Request, completion_room
from knapspec.validators import check_finite

if TYPE_CHECKING:
    from knapspec.decoding.prefix_cache import PrefixCache
    from knapspec.drafters.base import Drafter
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import ForwardOutput, SublayerEngine
    from knapspec.planners.batch.policy import BatchDraftPolicy

#: ``(prompt (n,), its prefill in the single-sequence cache, the prefill's output) ->`` the
#: sub-network the batch may draft with (None: none). Called once, after the first row's
#: prefill; the output carries the item points when ``capture_points`` asks for them.
SubnetworkPlanner = Callable[[torch.Tensor, "KVCache", "ForwardOutput"], BatchSubnetwork | None]


@attrs.frozen
class BatchMode:
    """What a batch's owner chooses: a server's batch or one ``generate_batch`` call's.

    Attributes:
        reuse_lanes: a finished row's lane takes a later request, which keeps the lane's
            drafters (a lookup drafter's history holds the lane's earlier requests) and
            starts from its acceptance estimates. False: every request gets a lane of its
            own, never reused, so fresh drafter copies and fresh estimates (``lanes`` is
            then the number of requests).
        rows_fail_alone: a row whose verification logits are not finite stops with
            ``"error"`` and every other row goes on. False: such logits raise
            :class:`~knapspec.errors.NonFiniteLogitsError` (the whole call fails).
        fixed_capacity: ``capacity`` is the size of a row for any request: capped by the
            model's context, and :meth:`ContinuousBatch.add` refuses a request that does
            not fit (:func:`~knapspec.request.completion_room`). False: the owner sized it
            for the requests it will add, and it is used as given.
    """

    reuse_lanes: bool
    rows_fail_alone: bool
    fixed_capacity: bool


#: A server's batch: lanes reused across requests, rows fail alone, a fixed row size.
SERVING = BatchMode(reuse_lanes=True, rows_fail_alone=True, fixed_capacity=True)
#: One ``generate_batch`` call: a lane per request, the call fails on non-finite logits, the
#: cache sized for the call's requests.
ONE_CALL = BatchMode(reuse_lanes=False, rows_fail_alone=False, fixed_capacity=False)


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


class ContinuousBatch:
    """A batch whose rows are added and cancelled between rounds (module docstring).

    Built by :meth:`knapspec.SpeculativeDecoder.continuous_batch` for a server and by
    ``generate_batch`` for one call, which pass the decoder's engine, caches, drafters and
    batch policy.

    Args:
        engine: the decoder's engine.
        scratch: a single-sequence cache each prompt is prefilled in, one at a time.
        lanes: how many lanes (>= 1): rows decoded at once, or with ``mode.reuse_lanes``
            off, the requests the batch will take.
        capacity: token slots per row: a row's prompt + ``max_new_tokens`` + the largest
            draft must fit (the batch K/V cache holds ``slots × capacity`` tokens).
        policy: chooses each row's γ and drafter per round.
        max_draft_length: the most tokens a row drafts in one round.
        drafters: by registered name, the decoder's drafters: those in ``proposers`` are
            copied per lane (``for_row``), the one the sub-network plan names drafts the
            rows together (``propose_batch``).
        proposers: the drafters that propose before every round (the planner's
            ``proposal_drafters()``).
        plan_subnetwork: chooses the sub-network on the first row admitted (None: lookup
            drafts only).
        capture_points: the first row's prefill records the item points (the planner
            reads them as its reference window).
        prefix_cache: where each row's prefill looks up the longest cached prefix of its
            prompt (and keeps the prompt's K/V for later calls); None: none.
        lock: held during every :meth:`add` and :meth:`step` (a server's batch: the
            decoder's); None: the owner holds one around its whole use.
        slots: rows decoded at once (None: ``lanes``; at most ``lanes``).
        mode: the owner's choices (:class:`BatchMode`; default: a server's).
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
        drafters: Mapping[str, Drafter],
        proposers: Iterable[str],
        plan_subnetwork: SubnetworkPlanner | None,
        capture_points: bool,
        prefix_cache: PrefixCache | None,
        lock: threading.Lock | None,
        slots: int | None = None,
        mode: BatchMode = SERVING,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        slots = lanes if slots is None else slots
        if not 1 <= slots <= lanes:
            raise ValueError(f"slots must be in 1..lanes ({lanes}), got {slots}")
        if mode.fixed_capacity:
            capacity = min(capacity, engine.max_context)
            if capacity <= max_draft_length + 1:
                raise ValueError(
                    f"capacity {capacity} leaves no room for a prompt and its drafts "
                    f"(max_draft_length {max_draft_length})"
                )
        self.engine = engine
        self.synchronize = engine.device.type == "cuda"
        #: When the batch was built: each row's ``wall_time_s`` runs from here.
        self.started = self._now()
        self.scratch = scratch
        self.lanes = lanes
        self.slots = slots
        self.capacity = capacity
        self.policy = policy
        self.max_draft_length = max_draft_length
        self.plan_subnetwork = plan_subnetwork
        self.capture_points = capture_points
        self.prefix_cache = prefix_cache
        self.mode = mode
        self._lock = lock
        #: The batch's shared sub-network, once the first row admitted planned it.
        self.subnetwork: BatchSubnetwork | None = None
        #: Per lane, its latest row (kept after the row stops, until the lane's next one).
        self.rows: dict[int, Row] = {}
        names = sorted(proposers)
        self._lane_drafters = [
            [drafters[name].for_row(engine) for name in names] for _ in range(lanes)
        ]
        for column in zip(*self._lane_drafters, strict=True):  # one drafter kind, every lane
            for drafter in column:
                drafter.share_rows(column)
        self._rounds = BatchRound(
            engine,
            policy,
            max_draft_length=max_draft_length,
            shared_drafters=drafters,
            clock=self._now,
            rows_fail_alone=mode.rows_fail_alone,
        )
        self._cache = new_batch_cache(engine, slots, capacity)
        self._cache.keep([])  # no active row yet: each enters through add()
        self.policy.reset(lanes)
        self.policy.use_subnetwork(None)
        self._active: list[int] = []  # lanes, in cache order
        self._free = list(range(lanes))  # lanes add() may take, lowest first

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> list[int]:
        """Lanes decoding now, in batch order."""
        return list(self._active)

    @property
    def free_lanes(self) -> int:
        """How many rows :meth:`add` can take now."""
        return min(len(self._free), self.slots - len(self._active))

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a row with ``prompt_tokens`` prompt tokens may ask for
        (:func:`~knapspec.request.completion_room` of a row of :attr:`capacity`)."""
        return completion_room(self.capacity, prompt_tokens, self.max_draft_length)

    def elapsed(self) -> float:
        """Seconds since the batch was built (the device synchronised)."""
        return self._now() - self.started

    # ------------------------------------------------------------------ calls
    def add(self, request: Request) -> RowUpdate:
        """Prefill ``request``'s prompt alone, give it a lane and commit its first token
        (its ``streamer`` and ``logits_processor`` are not used: a batch row has none).

        Raises:
            RuntimeError: no free lane.
            ValueError: a fixed-capacity batch has no room for prompt + ``max_new_tokens``
                in a row.
            NonFiniteLogitsError: the prefill's logits were not finite (the row is not
                added; the batch is unharmed).
        """
        if not self.free_lanes:
            raise RuntimeError("no free lane: every row of the batch is decoding")
        prompt_tokens = request.prompt_tokens
        if self.mode.fixed_capacity and request.max_new_tokens > self.room(prompt_tokens):
            raise ValueError(
                f"{prompt_tokens} prompt tokens + {request.max_new_tokens} new tokens do not "
                f"fit a row of {self.capacity} tokens (draft room {self.max_draft_length})"
            )
        lane = self._free[0]
        sampler = TokenSampler.for_request(request, self.engine.device)
        self.rows[lane] = Row(request, sampler, self._lane_drafters[lane])
        with self._locked(), torch.inference_mode():
            self._admit(lane)
        self._free.remove(lane)
        update = self._update(lane)
        self._retire_stopped()  # a row may stop on its first token
        return update

    def cancel(self, lane: int) -> None:
        """Stop ``lane``'s row; it leaves the batch before the next round."""
        if lane in self._active and not self.rows[lane].stopped:
            self.rows[lane].stats.stop_reason = CANCELLED
        self._retire_stopped()

    def step(self) -> list[RowUpdate]:
        """One batched round over the active rows; per row, what it committed. Rows that
        stopped (their limit, a stop id, non-finite logits) have left the batch after it."""
        self._retire_stopped()
        lanes = list(self._active)
        if not lanes:
            return []
        with self._locked(), torch.inference_mode():
            self._round()
        updates = [self._update(lane) for lane in lanes]
        self._retire_stopped()
        return updates

    # ------------------------------------------------------------------ the loop's parts
    def _admit(self, lane: int) -> None:
        """Prefill ``lane``'s row alone, move its K/V into a free slot of the batch cache
        and commit its first token; the first row admitted also plans the sub-network."""
        engine, row, scratch = self.engine, self.rows[lane], self.scratch
        prompt = row.request.prompt
        started = self._now()
        prefixes = self.prefix_cache
        reused = prefixes.restore(prompt, scratch) if prefixes is not None else 0
        scratch.crop(reused)  # 0: empty
        planner = self.plan_subnetwork
        capture = planner is not None and self.capture_points
        new = prompt.numel() - reused
        out = engine.forward(
            prompt[reused:],
            reused,
            scratch,
            all_logits=False,
            capture_points=capture,
            capture_last=min(PREFILL_WINDOW_TOKENS, new) if capture else None,
        )
        row.stats.cached_prompt_tokens = reused
        if prefixes is not None:
            prefixes.store(prompt, scratch, prompt.numel())
        check_finite(out.logits, f"prefill of row {lane}", error=NonFiniteLogitsError.during)
        self._cache.append_row(scratch, prompt.numel())
        self._active.append(lane)
        token, _ = row.sampler.choose(out.logits[-1], prompt.numel())
        row.pending = token
        row.commit([token])
        for drafter in row.drafters:
            drafter.reset([*prompt.tolist(), token])
        row.stats.prefill_time_s = self._now() - started
        if planner is not None:
            # Planned once: the scratch cache still holds this row's prefill, which the
            # planner reads.
            self.plan_subnetwork = None
            plan_start = self._now()
            self.subnetwork = planner(prompt, scratch, out)
            self.policy.use_subnetwork(self.subnetwork)
            row.stats.plan_time_s += self._now() - plan_start

    def _round(self) -> None:
        """One batched round over the active rows (:class:`BatchRound`)."""
        rows = [self.rows[lane] for lane in self._active]
        self._rounds.run(self._active, rows, self._cache, self.subnetwork)

    def _retire(self) -> None:
        """Drop rows that stopped; pack the cache onto the rows still running. The last
        running rows move into the freed slots (the others stay put), so a retirement
        copies one row's K/V per freed slot, not every row behind it."""
        active = self._active
        running = [slot for slot, lane in enumerate(active) if not self.rows[lane].stopped]
        if len(running) == len(active):
            return
        now = self._now()
        for lane in active:
            if self.rows[lane].stopped:
                self.rows[lane].stats.wall_time_s = now - self.started
        count = len(running)
        staying = set(running)
        movers = iter(slot for slot in running if slot >= count)
        keep = [slot if slot in staying else next(movers) for slot in range(count)]
        active[:] = [active[slot] for slot in keep]
        self._cache.keep(keep)

    def _retire_stopped(self) -> None:
        stopped = [lane for lane in self._active if self.rows[lane].stopped]
        if not stopped:
            return
        self._retire()
        if self.mode.reuse_lanes:
            self._free.extend(stopped)
            self._free.sort()

    def _update(self, lane: int) -> RowUpdate:
        row = self.rows[lane]
        new = row.unreported()
        row.stats.new_tokens = len(row.output)
        return RowUpdate(lane, new, row.stats.stop_reason, row.stats)

    def _locked(self) -> contextlib.AbstractContextManager[object]:
        return self._lock if self._lock is not None else contextlib.nullcontext()

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()


__all__ = [
    "CANCELLED",
    "FAILED",
    "ONE_CALL",
    "SERVING",
    "BatchMode",
    "ContinuousBatch",
    "RowUpdate",
    "SubnetworkPlanner",
]
