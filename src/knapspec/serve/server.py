"""``knapspec serve``'s process: the scheduler thread, the app, uvicorn, SIGTERM drain.

The port opens at once and answers 503 while the scheduler thread loads the model and
warms it up (one short batched call, so the first client does not pay for compiling
kernels). SIGTERM (or Ctrl-C) drains: new requests get 503, uvicorn closes the port and
lets the responses in flight finish for up to ``drain_timeout`` seconds, then the
scheduler cancels whatever is left and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from sse_starlette.sse import AppStatus

from knapspec.serve.app import create_app
from knapspec.serve.metrics import ServerMetrics
from knapspec.serve.scheduler import Backend, Scheduler
from knapspec.serve.text import SharedTokenizer

if TYPE_CHECKING:
    from knapspec.config import DecoderConfig

LOG = logging.getLogger("knapspec.serve")

#: Rows are capped at this many tokens unless ``--max-model-len`` says otherwise: the
#: batch K/V cache is allocated for ``max_batch × max_model_len`` tokens up front.
DEFAULT_MAX_MODEL_LEN = 4096


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the scheduler to refuse new work on the first signal."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.scheduler.begin_drain()
        super().handle_exit(sig, frame)


def loader(
    model: str,
    dtype: str,
    config: DecoderConfig,
    *,
    max_model_len: int | None,
    served_model_name: str | None,
) -> Any:
    """The scheduler's ``load``: model, tokenizer and decoder as ``knapspec generate``
    builds them (the same ``--model``, ``--dtype``, ``--config`` and ``--set``)."""

    def load() -> Backend:
        from knapspec.decoding.decoder import SpeculativeDecoder
        from knapspec.model.loading.by_name import load_model
        from knapspec.model.loading.provision import known_model

        loaded, tokenizer = load_model(model, dtype)
        decoder = SpeculativeDecoder.from_config(loaded, config)
        limit = min(max_model_len or DEFAULT_MAX_MODEL_LEN, decoder.engine.max_context)
        eos: set[int] = set()
        for source in (tokenizer.eos_token_id, loaded.generation_config.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(token) for token in source)
        known = known_model(model)
        name = served_model_name or (known.name if known is not None else Path(model).name)
        backend = Backend(decoder, SharedTokenizer(tokenizer), name, limit, frozenset(eos))
        _warm_up(backend)
        LOG.info("serving %s: rows of %d tokens", name, limit)
        if not backend.tokenizer.has_chat_template:
            LOG.warning(
                "%s has no chat template (a base model): /v1/chat/completions answers 400, "
                "/v1/completions continues text",
                name,
            )
        return backend

    return load


def _warm_up(backend: Backend) -> None:
    """One short batched call: kernels compile and caches fill before the first client."""
    from knapspec.request import Request

    ids = backend.tokenizer.encode("Hello") or [0]
    batch = backend.decoder.continuous_batch(1, min(64, backend.max_model_len))
    batch.add(Request(ids[:8], 4))
    while batch.active:
        batch.step()


def serve(
    load: Any,
    *,
    host: str,
    port: int,
    api_key: str | None,
    max_batch: int,
    max_queue: int,
    drain_timeout: float,
    log_level: str = "info",
) -> int:
    """Run the server until SIGTERM / Ctrl-C; returns the exit code (0 after a drain)."""
    # sse-starlette ends every stream on the first SIGTERM by default; a drain lets them
    # finish (uvicorn still cancels what outlives --drain-timeout).
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
    metrics = ServerMetrics()
    holder: list[uvicorn.Server] = []

    def give_up() -> None:  # the model did not load: stop serving 503s, exit 1
        for running in holder:
            running.should_exit = True

    scheduler = Scheduler(
        load, metrics, max_batch=max_batch, max_queue=max_queue, on_load_failure=give_up
    )
    app = create_app(scheduler, metrics, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, round(drain_timeout)),
        access_log=False,
    )
    server = _DrainingServer(config, scheduler)
    holder.append(server)
    scheduler.start()
    # uvicorn raises the signal it drained on again once it is done, under the handlers
    # it found: let that be a no-op, so that a drained server exits 0 (not -15 or 130).
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
        clean = scheduler.stop(timeout=drain_timeout)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(
        "knapspec: stopped" + ("" if clean else " (requests still running were cancelled)"),
        file=sys.stderr,
    )
    code = 0
    if scheduler.error is not None:
        print(f"knapspec: error: loading the model failed: {scheduler.error}", file=sys.stderr)
        code = 1
    if scheduler.busy:
        # Stopped while the model was still loading or measuring: that thread cannot be
        # interrupted, and tearing the interpreter down under it aborts the process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _ignore(sig: int, frame: FrameType | None) -> None:
    """A signal handler that does nothing (the drain has already happened)."""


def api_key_from(value: str | None) -> str | None:
    """``--api-key``, else ``$KNAPSPEC_API_KEY`` (keeps the key out of ``ps``), else None."""
    return value or os.environ.get("KNAPSPEC_API_KEY") or None


__all__ = ["DEFAULT_MAX_MODEL_LEN", "api_key_from", "loader", "serve"]
