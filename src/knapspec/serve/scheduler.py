"""The one thread that owns the model: a queue in front of a continuous batch.

:class:`Scheduler` loads the model on its own thread (the server answers 503 meanwhile),
then loops: admit waiting requests into free rows (each prefilled alone, reusing the
prefix cache), run one batched speculative round over every running row
(:class:`~knapspec.decoding.continuous.ContinuousBatch`), hand each request its new text,
retire rows that stopped or whose client went away. Requests join and leave only at these
step boundaries, and every row keeps the batch path's exactness contract, so an answer
does not depend on what else was running.

It never sees HTTP: a :class:`GenerationRequest` carries a ``sink``, a callable the
scheduler thread calls with each :class:`Event` (the app forwards them to its event loop).
A request that fails (its logits not finite, its prefill refused) gets a
:class:`Failed` event and the others go on; an error the batch cannot attribute to one row
fails the running rows and starts a fresh batch, and the server stays up.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from knapspec.decoding.continuous import CANCELLED, FAILED, RowUpdate
from knapspec.request import Request
from knapspec.serve.text import SharedTokenizer, TextStream

if TYPE_CHECKING:
    from knapspec.decoding.continuous import ContinuousBatch
    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.decoding.stats import GenerationStats
    from knapspec.serve.metrics import ServerMetrics

LOG = logging.getLogger("knapspec.serve")

LOADING, READY, DRAINING, STOPPED, BROKEN = "loading", "ready", "draining", "stopped", "failed"


@attrs.frozen
class Backend:
    """What the scheduler serves: a decoder, its tokenizer and the limits of a row.

    Attributes:
        decoder: the speculative decoder (its config decides drafting and sampling
            defaults).
        tokenizer: the model's tokenizer.
        model_name: the name clients send as ``model``.
        max_model_len: tokens per row: prompt + completion (+ the draft room).
        stop_ids: the model's end-of-sequence ids.
    """

    decoder: SpeculativeDecoder
    tokenizer: SharedTokenizer
    model_name: str
    max_model_len: int
    stop_ids: frozenset[int]


# ---------------------------------------------------------------------------- events
@attrs.frozen
class Delta:
    """New text of a request (``tokens`` committed since the last event)."""

    text: str
    tokens: int


@attrs.frozen
class Finished:
    """The request is done: ``reason`` is ``"stop"`` or ``"length"`` (OpenAI's names)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@attrs.frozen
class Failed:
    """The request failed alone (``message`` says why; the server goes on)."""

    message: str


Event = Delta | Finished | Failed


@attrs.define(eq=False)
class GenerationRequest:
    """One request as the scheduler holds it: the decoding record and what only the
    server needs (see the module docstring).

    Attributes:
        request: what its row decodes (prompt, ``max_new_tokens``, sampling, the model's
            stop ids, seed), handed to the batch as it is.
        stop: stop strings (the answer ends before the first one).
        sink: called on the scheduler thread with each :class:`Event`, in order; must
            not block.
        id: for logs.
    """

    request: Request
    stop: tuple[str, ...]
    sink: Callable[[Event], None]
    id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    arrived: float = attrs.field(factory=time.perf_counter)
    cancelled: bool = False
    lane: int | None = None
    text: TextStream | None = None
    first_token_at: float | None = None


class Unavailable(Exception):
    """The server is loading, draining or broken: try later (HTTP 503)."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the server is {state}")
        self.state = state


class QueueFull(Exception):
    """Every row is busy and the queue is full: try later (HTTP 429)."""


class Scheduler:
    """Owns the model on one thread; continuous batching across requests.

    Args:
        load: builds the :class:`Backend` (model load, measurements); runs on the
            scheduler thread, so the server can answer 503 meanwhile.
        metrics: where to count.
        max_batch: rows decoded at once.
        max_queue: requests that may wait for a row; more get :class:`QueueFull`.
        on_load_failure: called (on the scheduler thread) when ``load`` raised.
    """

    def __init__(
        self,
        load: Callable[[], Backend],
        metrics: ServerMetrics,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        on_load_failure: Callable[[], None] | None = None,
    ) -> None:
        self._load = load
        self._on_load_failure = on_load_failure
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.state = LOADING
        self.error: str | None = None
        self.backend: Backend | None = None
        self._waiting: deque[GenerationRequest] = deque()
        self._running: dict[int, GenerationRequest] = {}
        self._stats: dict[int, GenerationStats] = {}  # a finishing row's, for the metrics
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="knapspec-scheduler", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``.

        Raises:
            Unavailable: not ready (loading, draining, broken).
            QueueFull: ``max_queue`` requests already wait.
        """
        with self._cond:
            if self.state != READY:
                raise Unavailable(self.state)
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue)")
            self._waiting.append(request)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request: GenerationRequest) -> None:
        """Drop ``request`` (its client went away): its row leaves at the next step
        boundary, or it leaves the queue. Idempotent."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        with self._cond:
            return len(self._waiting), len(self._running)

    @property
    def busy(self) -> bool:
        """Whether the scheduler thread still runs (after :meth:`stop`: it was loading)."""
        return self._thread.is_alive()

    def begin_drain(self) -> None:
        """Refuse new requests (503); those queued or running go on."""
        with self._cond:
            if self.state in (READY, LOADING):
                self.state = DRAINING
            self._cond.notify()

    def stop(self, timeout: float) -> bool:
        """Drain, wait up to ``timeout`` seconds for every request to finish, then cancel
        what is left and end the thread. True when nothing had to be cancelled."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            clean = not (self._waiting or self._running)
            for request in [*self._waiting, *self._running.values()]:
                request.cancelled = True
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and self.backend is not None:  # loading cannot be cut
            self._thread.join(timeout=30)
        self.state = STOPPED
        return clean

    # ------------------------------------------------------------------ scheduler thread
    def _main(self) -> None:
        try:
            self.backend = self._load()
        except Exception as error:  # the server reports it on /health and refuses work
            LOG.exception("loading the model failed")
            with self._cond:
                self.error = f"{type(error).__name__}: {error}"
                self.state = BROKEN
            if self._on_load_failure is not None:
                self._on_load_failure()
            return
        with self._cond:
            if self.state == LOADING:
                self.state = READY
        batch = self._new_batch()
        while True:
            with self._cond:
                while not self._stop and not self._work():
                    self._cond.wait()
                if self._stop:
                    break
                admitted = self._take_admissions(batch.free_lanes)
            for request in admitted:
                self._admit(batch, request)
            self._drop_cancelled(batch)
            if batch.active:
                try:
                    self._step(batch)
                except Exception:  # not one row's fault: fail the batch, keep serving
                    LOG.exception("a batched round failed; failing its %d rows", len(batch.active))
                    for lane in list(self._running):
                        self._finish(lane, Failed("internal error in the batched round"))
                    batch = self._new_batch()
        for lane in list(self._running):
            self._finish(lane, Failed("the server stopped"))
        for request in self._waiting:
            request.sink(Failed("the server stopped"))

    def _new_batch(self) -> ContinuousBatch:
        backend = self.backend
        assert backend is not None
        return backend.decoder.continuous_batch(self.max_batch, backend.max_model_len)

    def _work(self) -> bool:
        """Whether the loop has something to do (called with the lock held)."""
        cancelled = any(r.cancelled for r in self._running.values())
        return bool(self._waiting or self._running) or cancelled

    def _take_admissions(self, free: int) -> list[GenerationRequest]:
        """Up to ``free`` waiting requests, oldest first; cancelled ones dropped."""
        taken: list[GenerationRequest] = []
        while self._waiting and len(taken) < free:
            request = self._waiting.popleft()
            if request.cancelled:
                self.metrics.requests.labels(CANCELLED).inc()
                continue
            taken.append(request)
        self.metrics.queue_depth.set(len(self._waiting))
        return taken

    def _admit(self, batch: ContinuousBatch, request: GenerationRequest) -> None:
        backend = self.backend
        assert backend is not None
        try:
            update = batch.add(request.request)
        except Exception as error:  # this request's own fault (its prefill): it fails alone
            LOG.warning("request %s failed at prefill: %s", request.id, error)
            self.metrics.requests.labels(FAILED).inc()
            request.sink(Failed(f"{type(error).__name__}: {error}"))
            return
        request.lane = update.lane
        request.text = TextStream(backend.tokenizer, request.stop)
        with self._cond:
            self._running[update.lane] = request
        self.metrics.prefill_time.observe(update.stats.prefill_time_s)
        self.metrics.prompt_tokens.inc(update.stats.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(update.stats.cached_prompt_tokens)
        self.metrics.batch_size.set(len(self._running))
        self._deliver(batch, update)

    def _drop_cancelled(self, batch: ContinuousBatch) -> None:
        for lane, request in list(self._running.items()):
            if request.cancelled:
                batch.cancel(lane)
                self._finish(lane, None, outcome=CANCELLED)

    def _step(self, batch: ContinuousBatch) -> None:
        started = time.perf_counter()
        updates = batch.step()
        self.metrics.step_time.observe(time.perf_counter() - started)
        for update in updates:
            self.metrics.tokens_per_step.observe(len(update.tokens))
            self._deliver(batch, update)

    def _deliver(self, batch: ContinuousBatch, update: RowUpdate) -> None:
        """Send a row's new text; finish its request when it stopped (its own stop, a stop
        string, its limit, an error)."""
        request = self._running.get(update.lane)
        if request is None or request.text is None:
            return
        now = time.perf_counter()
        if update.tokens and request.first_token_at is None:
            request.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.arrived)
        self.metrics.generation_tokens.inc(len(update.tokens))
        text = request.text.push(update.tokens)
        if text:
            request.sink(Delta(text, len(update.tokens)))
        if update.stop_reason == FAILED:
            self._finish(update.lane, Failed("the model's logits were not finite (NaN or inf)"))
            return
        if request.text.stopped and not update.stop_reason:
            batch.cancel(update.lane)  # a stop string: the row is done, free it now
        if request.text.stopped or update.stop_reason:
            tail = request.text.finish()
            if tail:
                request.sink(Delta(tail, 0))
            stats = update.stats
            reason = "length" if stats.stop_reason == "max_new_tokens" else "stop"
            if request.text.stopped:
                reason = "stop"
            self._stats[update.lane] = stats
            self._finish(
                update.lane,
                Finished(reason, stats.prompt_tokens, stats.new_tokens, stats.cached_prompt_tokens),
            )

    def _finish(self, lane: int, event: Event | None, outcome: str | None = None) -> None:
        with self._cond:
            request = self._running.pop(lane, None)
            self._cond.notify_all()  # stop() waits for the running set to empty
        if request is None:
            return
        if isinstance(event, Finished):
            outcome = event.reason
            self.metrics.request_time.observe(time.perf_counter() - request.arrived)
            stats = self._stats.pop(lane, None)
            if stats is not None:
                self.metrics.drafted_tokens.inc(stats.drafted_tokens)
                self.metrics.accepted_tokens.inc(stats.accepted_tokens)
        elif isinstance(event, Failed):
            outcome = FAILED
        self.metrics.requests.labels(outcome or FAILED).inc()
        self.metrics.batch_size.set(len(self._running))
        if event is not None:
            request.sink(event)


__all__ = [
    "BROKEN",
    "DRAINING",
    "LOADING",
    "READY",
    "STOPPED",
    "Backend",
    "Delta",
    "Event",
    "Failed",
    "Finished",
    "GenerationRequest",
    "QueueFull",
    "Scheduler",
    "Unavailable",
]
