"""The one error shape of llmserve's APIs, and its one mapping to gRPC status and HTTP.

Every error a client is told about is an `ApiError`: its class decides the gRPC code, the HTTP
status and the OpenAI error `type`; its message is built once, in the constructor. Anything
else that escapes a handler is an internal failure: gRPC INTERNAL / HTTP 500, never dressed up
as the client's mistake (a stray `LookupError` is not a 404).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import grpc


class ApiError(Exception):
    """An error the client is told about. Subclasses fix the codes; `message` is the text."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INVALID_ARGUMENT
    http_status: ClassVar[int] = 400
    # OpenAI's `error.type`.
    kind: ClassVar[str] = "invalid_request_error"
    # OpenAI's `error.code`, when it has one for this error.
    code: ClassVar[str | None] = None

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request field at fault (OpenAI's `error.param`), or None.
        self.field = field


class FieldError(ApiError, ValueError):
    """A request field is invalid: `field` names it (dotted for nested ones, `messages[2].role`),
    `detail` says what is wrong. The message is "field: detail"."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}", field)
        self.detail = detail


class NotFoundError(ApiError):
    """The request names something that does not exist (a model, a worker)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class AlreadyExistsError(ApiError):
    """The request names something that already exists (a request id in use)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class FailedPreconditionError(ApiError):
    """The service is not in a state that allows the call (a stream already open, a cache
    not yet allocated, a drained worker registering again)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class UnauthenticatedError(ApiError):
    """No credential, or a wrong one."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    code = "invalid_api_key"


class ResourceExhaustedError(ApiError):
    """A resource the request needs cannot be had (memory for a KV cache)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    kind = "rate_limit_error"


class OverloadedError(ResourceExhaustedError):
    """Admission refused: a queue or in-flight limit is full. Retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(ApiError):
    """The service cannot serve now (no worker, shutting down); the request may be retried."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    kind = "service_unavailable"


class DeadlineExceededError(ApiError):
    """The request's deadline or timeout passed before it finished."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    kind = "timeout_error"


class InternalError(ApiError):
    """An internal failure the client is told about with its message: one relayed from a
    service we called (see `from_status`), or a request the scheduler gave up on. Unexpected
    exceptions are not wrapped: they escape as whatever they are, and map to INTERNAL too."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    kind = "internal_error"


# The class a status relayed from another llmserve service becomes: the inverse of
# `grpc_status` for our own classes. FieldError and ModelNotFoundError come back as their
# bases (the message is already built; the field travels beside it).
_BY_CODE: dict[grpc.StatusCode, type[ApiError]] = {
    cls.grpc_code: cls
    for cls in (
        ApiError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        UnauthenticatedError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
    )
}


def from_status(code: grpc.StatusCode, message: str, field: str | None = None) -> ApiError:
    """The ApiError for a gRPC status received from another service, code kept. A code we
    never send (UNKNOWN, CANCELLED, ...) is an internal failure over there."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return InternalError(f"{code.name}: {message}", field)
    if cls is ResourceExhaustedError:
        return OverloadedError(message)
    return cls(message, field)


def from_status_value(value: int, message: str, field: str | None = None) -> ApiError:
    """`from_status` for a code sent as its number (scheduler.proto's RequestError.code)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)
    return from_status(code, message, field)


@dataclass(frozen=True, slots=True)
class HttpError:
    """What an HTTP response carries for an exception."""

    status: int
    kind: str
    message: str
    param: str | None
    code: str | None


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an exception escaping a servicer. An internal
    failure's message names the exception and its text: our gRPC peers are our own services,
    which log it (the scheduler logs why a worker's step failed)."""
    if isinstance(exc, ApiError):
        return exc.grpc_code, exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def http_error(exc: BaseException) -> HttpError:
    """The HTTP status and OpenAI error body for an exception escaping a route."""
    if isinstance(exc, ApiError):
        return HttpError(exc.http_status, exc.kind, exc.message, exc.field, exc.code)
    return HttpError(500, "internal_error", f"internal error: {type(exc).__name__}", None, None)


def string_field(item: dict[str, Any], key: str, where: str) -> str:
    """`item[key]` when it is a string, else a FieldError naming `where.key` (request bodies
    of free-form objects: the Responses and Messages APIs' items and blocks)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key}", "must be a string")
    return value
