"""The FastAPI app: parse, validate, hand over to the scheduler, stream back.

Routes never touch the model: they turn a request into token ids and a
:class:`~knapspec.serve.scheduler.GenerationRequest` (the decoding record,
:class:`knapspec.request.Request`, with the stop strings and the event sink), submit it,
and forward the scheduler's events (text deltas, the finish, a failure) to the client, as
one JSON answer or as Server-Sent Events (``sse-starlette`` frames them). Every error is
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request it
cannot serve (naming the field), 401 without the API key, 404 for an unknown model, 429 with
``Retry-After`` when the queue is full, 503 while loading or draining, 500 when the
request failed on the server (it fails alone).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sse_starlette.sse import EventSourceResponse

from knapspec.request import Request as DecodingRequest
from knapspec.request import completion_room
from knapspec.sampling import SamplingParams
from knapspec.serve.errors import APIError, install_error_handlers
from knapspec.serve.metrics import ServerMetrics
from knapspec.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorBody,
    ModelCard,
    ModelList,
    Usage,
)
from knapspec.serve.scheduler import (
    READY,
    Backend,
    Delta,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    Scheduler,
    Unavailable,
)

#: Seconds a client is asked to wait after a 429 or 503 (Retry-After).
RETRY_AFTER_S = 1
#: Default completion limit of /v1/completions when max_tokens is absent (OpenAI's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def create_app(scheduler: Scheduler, metrics: ServerMetrics, *, api_key: str | None) -> FastAPI:
    """The server's routes over ``scheduler`` (started by the caller)."""
    app = FastAPI(title="knapspec", docs_url=None, redoc_url=None)
    bearer = HTTPBearer(auto_error=False)

    def authorize(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )

    install_error_handlers(app, metrics)

    def backend() -> Backend:
        if scheduler.state != READY or scheduler.backend is None:
            detail = f": {scheduler.error}" if scheduler.error else ""
            raise APIError(
                503,
                f"the server is {scheduler.state}{detail}; retry later",
                type="service_unavailable",
                code=f"server_{scheduler.state}",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return scheduler.backend

    @app.get("/health")
    def health() -> JSONResponse:
        waiting, running = scheduler.load
        body: dict[str, Any] = {"status": scheduler.state, "waiting": waiting, "running": running}
        if scheduler.error:
            body["error"] = scheduler.error
        return JSONResponse(body, status_code=200 if scheduler.state == READY else 503)

    @app.get("/metrics")
    def metrics_text() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    def models() -> ModelList:
        served = backend()
        return ModelList(data=[ModelCard(id=served.model_name, max_model_len=served.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        served = _check_model(backend(), body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            ids = served.tokenizer.encode(prompt) if prompt else []
        else:
            ids = [int(token) for token in prompt]
            bad = [t for t in ids if not 0 <= t < served.decoder.engine.vocab_size]
            if bad:
                raise APIError(400, f"token ids out of the vocabulary: {bad[:5]}", param="prompt")
        job = _job(served, body, ids, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _stream(scheduler, job, _completion_chunks(rid, served, body.include_usage))
        answer = await _collect(scheduler, job, http)
        if answer is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed")
        reason, text, usage = answer
        return JSONResponse(
            CompletionResponse(
                id=rid,
                model=served.model_name,
                choices=[CompletionChoice(text=text, finish_reason=reason)],
                usage=usage,
            ).model_dump()
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        served = _check_model(backend(), body.model)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            ids = served.tokenizer.encode_chat(messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        except Exception as error:  # the template raised on these messages (jinja)
            raise APIError(
                400, f"the chat template refused the messages: {error}", param="messages"
            ) from error
        job = _job(served, body, ids, "messages", None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _stream(scheduler, job, _chat_chunks(rid, served, body.include_usage))
        answer = await _collect(scheduler, job, http)
        if answer is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed")
        reason, text, usage = answer
        return JSONResponse(
            ChatCompletionResponse(
                id=rid,
                model=served.model_name,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)],
                usage=usage,
            ).model_dump()
        )

    return app


# ---------------------------------------------------------------------------- requests
@attrs.define
class _Job:
    """A validated request, not yet submitted: the record plus its event queue."""

    request: GenerationRequest
    events: asyncio.Queue[Event]


def _check_model(served: Backend, model: str) -> Backend:
    if model != served.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist here; this server serves {served.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return served


def _job(
    served: Backend,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    prompt_field: str,
    default_max_tokens: int | None,
) -> _Job:
    """Check the prompt's size against a row, resolve the limit and the sampling.

    The limit goes from the body straight into the request's ``max_new_tokens``: chat's
    ``max_completion_tokens`` (OpenAI's newer name) when given, else ``max_tokens``, else
    ``default_max_tokens`` (None: all the room a row has).
    """
    if not ids:
        raise APIError(400, f"the {prompt_field} is empty", param=prompt_field)
    field, max_new_tokens = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens:
        field, max_new_tokens = "max_completion_tokens", body.max_completion_tokens
    room = completion_room(served.max_model_len, len(ids), served.decoder.max_draft_length)
    if room < 1:
        raise APIError(
            400,
            f"the {prompt_field} has {len(ids)} tokens; this server's rows hold "
            f"{served.max_model_len} (--max-model-len), prompt, completion and draft room "
            f"({served.decoder.max_draft_length}) together",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if max_new_tokens is not None and max_new_tokens > room:
        raise APIError(
            400,
            f"{field} = {max_new_tokens} does not fit: the prompt has {len(ids)} tokens, so "
            f"at most {room} more fit a row of {served.max_model_len} tokens (--max-model-len)",
            param=field,
            code="context_length_exceeded",
        )
    if max_new_tokens is None:
        max_new_tokens = min(room, default_max_tokens or room)
    base = served.decoder.sampling
    changes: dict[str, Any] = {}
    if body.temperature is not None:
        changes["do_sample"] = body.temperature > 0
        if body.temperature > 0:
            changes["temperature"] = body.temperature
    if body.top_p is not None:
        changes["top_p"] = body.top_p
    if body.seed is not None:
        changes["seed"] = body.seed % 2**64
    sampling: SamplingParams = attrs.evolve(base, **changes) if changes else base
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:  # on the scheduler thread: hand over, never block
        loop.call_soon_threadsafe(events.put_nowait, event)

    request = DecodingRequest(
        ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=served.stop_ids
    )
    return _Job(GenerationRequest(request, body.stop_strings, sink), events)


def _submit(scheduler: Scheduler, job: _Job) -> None:
    try:
        scheduler.submit(job.request)
    except QueueFull as error:
        scheduler.metrics.requests.labels("rejected_queue_full").inc()
        raise APIError(
            429,
            f"the server is at capacity ({error}); retry after {RETRY_AFTER_S} s",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from error
    except Unavailable as error:
        scheduler.metrics.requests.labels("rejected_unavailable").inc()
        raise APIError(
            503,
            f"{error}; retry later",
            type="service_unavailable",
            code=f"server_{error.state}",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from error


def _usage(done: Finished) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
    )


async def _collect(scheduler: Scheduler, job: _Job, http: Request) -> tuple[str, str, Usage] | None:
    """Submit and wait for the whole answer; None when the client went away (its row is
    cancelled within a step)."""
    _submit(scheduler, job)
    parts: list[str] = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    scheduler.cancel(job.request)
                    return None
                continue
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                return event.reason, "".join(parts), _usage(event)
            else:
                raise APIError(500, f"the request failed: {event.message}", type="server_error")
    except BaseException:
        scheduler.cancel(job.request)
        raise


ChunkMaker = Callable[[Event], list[dict[str, Any]]]


def _stream(scheduler: Scheduler, job: _Job, chunks: ChunkMaker) -> Response:
    """Submit (so that 429 / 503 come back as plain errors), then stream SSE frames."""
    _submit(scheduler, job)

    async def frames() -> AsyncIterator[dict[str, str]]:
        try:
            for chunk in chunks(Delta("", 0)):  # the opening chunk (the chat role)
                yield {"data": json.dumps(chunk)}
            while True:
                event = await job.events.get()
                if isinstance(event, Failed):
                    error = ErrorBody(
                        message=f"the request failed: {event.message}", type="server_error"
                    )
                    yield {"data": json.dumps({"error": error.model_dump()})}
                    break
                for chunk in chunks(event):
                    yield {"data": json.dumps(chunk)}
                if isinstance(event, Finished):
                    break
            yield {"data": "[DONE]"}
        finally:  # normal end, or the client went away (sse-starlette cancels us)
            scheduler.cancel(job.request)

    return EventSourceResponse(frames(), ping=15)


def _completion_chunks(rid: str, served: Backend, include_usage: bool) -> ChunkMaker:
    def chunks(event: Event) -> list[dict[str, Any]]:
        def chunk(text: str, reason: str | None, usage: Usage | None = None) -> dict[str, Any]:
            return CompletionResponse(
                id=rid,
                model=served.model_name,
                choices=[CompletionChoice(text=text, finish_reason=reason)]
                if usage is None
                else [],
                usage=usage,
            ).model_dump()

        if isinstance(event, Delta):
            return [chunk(event.text, None)] if event.text else []
        if isinstance(event, Finished):
            out = [chunk("", event.reason)]
            return [*out, chunk("", None, _usage(event))] if include_usage else out
        return []

    return chunks


def _chat_chunks(rid: str, served: Backend, include_usage: bool) -> ChunkMaker:
    opened = False

    def chunks(event: Event) -> list[dict[str, Any]]:
        nonlocal opened

        def chunk(delta: DeltaMessage, reason: str | None) -> dict[str, Any]:
            return ChatCompletionChunk(
                id=rid,
                model=served.model_name,
                choices=[ChatChunkChoice(delta=delta, finish_reason=reason)],
            ).model_dump(exclude_none=True)

        if isinstance(event, Delta):
            if not opened:
                opened = True
                return [chunk(DeltaMessage(role="assistant", content=""), None)]
            return [chunk(DeltaMessage(content=event.text), None)] if event.text else []
        if isinstance(event, Finished):
            out = [chunk(DeltaMessage(), event.reason)]
            if include_usage:
                usage = ChatCompletionChunk(
                    id=rid, model=served.model_name, choices=[], usage=_usage(event)
                ).model_dump()
                out.append(usage)
            return out
        return []

    return chunks


__all__ = ["create_app"]
