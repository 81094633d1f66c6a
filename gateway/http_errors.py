"""Errors of the OpenAI-compatible API: every exception becomes OpenAI's error body through
`llmserve.errors.http_error`, and the OpenAPI document lists those bodies."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.openai_protocol import ErrorBody, ErrorResponse
from llmserve.errors import ApiError, FieldError, http_error
from llmserve.logs import get_logger

log = get_logger(__name__)

# Seconds a refused client is told to wait (Retry-After): about one request's time.
RETRY_AFTER_S = 1.0


def error_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI's `{"error": {...}}` for an exception (an internal failure is logged here)."""
    if not isinstance(exc, ApiError):
        log.error("request failed", exc_info=exc)
    e = http_error(exc)
    return ErrorResponse(
        error=ErrorBody(message=e.message, type=e.kind, param=e.param, code=e.code)
    ).model_dump()


# Anthropic's error types by HTTP status, for the Messages API (/v1/messages).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _anthropic_type(status: int) -> str:
    # Anthropic uses invalid_request_error for the client errors it lists no type for.
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(exc: BaseException) -> dict[str, Any]:
    """Anthropic's `{"type": "error", "error": {"type", "message"}}` for an exception."""
    if not isinstance(exc, ApiError):
        log.error("request failed", exc_info=exc)
    e = http_error(exc)
    return {"type": "error", "error": {"type": _anthropic_type(e.status), "message": e.message}}


def error_response(exc: BaseException, path: str = "") -> JSONResponse:
    status = http_error(exc).status
    headers = None
    # A refusal that says when to come back: a full queue (429), a draining gateway or a lost
    # scheduler (503; behind a load balancer the retry may go to another replica at once).
    if status in (429, 503):
        retry_after = getattr(exc, "retry_after_s", RETRY_AFTER_S)
        headers = {"retry-after": str(max(1, math.ceil(retry_after)))}
    body = anthropic_error_body(exc) if is_anthropic_path(path) else error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    # Client mistakes are answered by the inner exception middleware. A handler registered for
    # `Exception` alone runs in Starlette's outermost middleware, which re-raises after
    # answering: every 400 was logged as a crash and the connection could be reset.
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request.url.path)

    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _framework_error)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, api_error)
    _drop_default_422(app)


async def _framework_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own refusals (a body it cannot parse, such as JSON nested too deep)."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        return error_response(FieldError("body", str(exc.detail)), request.url.path)
    if is_anthropic_path(request.url.path):  # a wrong method on /v1/messages, say
        error = {"type": _anthropic_type(exc.status_code), "message": str(exc.detail)}
        body = {"type": "error", "error": error}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
    return JSONResponse(
        ErrorResponse(
            error=ErrorBody(
                message=str(exc.detail), type="invalid_request_error", param=None, code=None
            )
        ).model_dump(),
        status_code=exc.status_code,
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Pydantic's first complaint, as a FieldError on the field the client named."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = param_name(first.get("loc", ()))
    detail = first.get("msg", "invalid request")
    if param is None:
        return error_response(ApiError(f"body: {detail}"), request.url.path)
    return error_response(FieldError(param, detail), request.url.path)


def param_name(loc: Any) -> str | None:
    """`messages[0].role` from pydantic's ("body", "messages", 0, "role"). Parts after a
    field that are not field names (union members such as "str" or "list[int]") are dropped:
    the client named the field, not our union."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        if isinstance(part, int):
            if not name:
                break  # a position in malformed JSON, not a field
            name += f"[{part}]"
        elif (
            isinstance(part, str)
            and part.isidentifier()
            and part.islower()
            and part not in _TYPE_TAGS
        ):
            name += f".{part}" if name else part
        else:
            break
    return name or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


# -- OpenAPI document -------------------------------------------------------------------------


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorResponse, "description": _ERROR_TEXT[status]} for status in statuses
    }


_ERROR_TEXT = {
    400: "Invalid request; `error.param` names the field",
    401: "Missing or wrong API key (with --api-key)",
    404: "The model is not served here",
    409: "A request with this id is already running",
    429: "Too many requests",
    503: "Overloaded (--max-pending-requests) or the scheduler is unavailable",
}


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The error shape of the Messages API's paths (`anthropic_error_body`)."""

    type: str
    error: AnthropicErrorBody


def anthropic_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": AnthropicError, "description": _ERROR_TEXT[status]} for status in statuses
    }


def _ok_or_events(model: type, description: str, **lines: str) -> dict[str, Any]:
    """A 200 answered as `model`'s JSON, or as server-sent events with these `lines` (name:
    what it holds). Before OpenAPI 3.2 the schema of an event stream describes one event."""
    event = {
        "type": "object",
        "required": list(lines),
        "properties": {name: {"type": "string", "description": d} for name, d in lines.items()},
    }
    return {
        "model": model,
        "description": description,
        "content": {"text/event-stream": {"schema": event}},
    }


def generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok = _ok_or_events(
        model,
        "The full response, or with `stream: true` server-sent events "
        "(`data: <chunk>` lines, then `data: [DONE]`)",
        data="a JSON chunk, an error, or [DONE]",
    )
    return {200: ok, **error_responses(400, 401, 404, 409, 429, 503)}


def messages_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok = _ok_or_events(
        model,
        "The message, or with `stream: true` server-sent events "
        "(`event: <type>` and `data: <json>` lines, ending with message_stop)",
        event="the event's type, e.g. message_start",
        data="the event as JSON",
    )
    return {200: ok, **anthropic_error_responses(400, 401, 404, 409, 429, 503)}


def _drop_default_422(app: FastAPI) -> None:
    """Validation errors are answered 400 in OpenAI's shape, not FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for operations in build()["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
