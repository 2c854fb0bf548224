"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

:class:`APIError` is what a route raises; :func:`install_error_handlers` turns it, pydantic's
validation errors (a 400 naming the first offending field) and Starlette's own (404, 405)
into that body.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knapspec.serve.metrics import ServerMetrics
from knapspec.serve.protocol import ErrorBody, ErrorResponse, UnsupportedFieldError


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorBody(message=message, type=type, param=param, code=code)
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        if error.status == 400:
            metrics.requests.labels("invalid").inc()
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        metrics.requests.labels("invalid").inc()
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(
            error.status_code, str(error.detail), type=kind, headers=dict(error.headers or {})
        ).response()


def _validation_error(error: RequestValidationError) -> APIError:
    """A 400 naming the first offending field (pydantic's message, OpenAI's shape)."""
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedFieldError):
        return APIError(400, str(cause), param=cause.field, code="unsupported_parameter")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # pydantic names the union member it tried (e.g. "str", "list[int]"): not a field.
    fields = [part for part in location if not any(c in part for c in "[]") and part != "str"]
    param = ".".join(fields) or None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "missing":
        message = f"missing required field {param!r}"
    elif first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}: this server does not support it"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code=str(first.get("type", "")) or None)


__all__ = ["APIError", "install_error_handlers"]
