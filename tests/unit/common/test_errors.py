"""llmserve.errors: one mapping each way between our error classes and gRPC / HTTP."""

from __future__ import annotations

import grpc
import pytest

from llmserve import errors
from llmserve.errors import (
    AlreadyExistsError,
    ApiError,
    FieldError,
    InternalError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
    from_status,
    from_status_value,
    grpc_status,
    http_error,
)


def test_field_error_builds_its_message_once() -> None:
    exc = FieldError("messages[2].role", "must be a non-empty string")
    assert (exc.field, exc.detail) == ("messages[2].role", "must be a non-empty string")
    assert exc.message == "messages[2].role: must be a non-empty string"
    assert grpc_status(exc) == (grpc.StatusCode.INVALID_ARGUMENT, exc.message)
    assert http_error(exc) == errors.HttpError(
        400, "invalid_request_error", exc.message, "messages[2].role", None
    )


def test_internal_failures_are_never_client_errors() -> None:
    # A stray LookupError (KeyError) is not a 404, a ValueError is not a 400.
    for exc in (KeyError("x"), LookupError("gone"), ValueError("bad"), RuntimeError("boom")):
        code, _ = grpc_status(exc)
        assert code == grpc.StatusCode.INTERNAL
        assert http_error(exc).status == 500
        assert http_error(exc).code is None


def test_model_not_found_is_404_with_openai_code() -> None:
    e = http_error(ModelNotFoundError("model: 'x' is not served here", "model"))
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("code", "cls", "http"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, ApiError, 400),
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError, 404),
        (grpc.StatusCode.ALREADY_EXISTS, AlreadyExistsError, 409),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError, 400),
        (grpc.StatusCode.UNAUTHENTICATED, errors.UnauthenticatedError, 401),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, OverloadedError, 429),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError, 504),
        (grpc.StatusCode.INTERNAL, InternalError, 500),
    ],
)
def test_a_relayed_status_keeps_its_code(
    code: grpc.StatusCode, cls: type[ApiError], http: int
) -> None:
    relayed = from_status(code, "what went wrong", "a.field")
    assert type(relayed) is cls
    assert grpc_status(relayed) == (code, "what went wrong")
    assert http_error(relayed).status == http
    assert relayed.field == ("a.field" if cls is not OverloadedError else None)
    # The number on scheduler.proto's RequestError.code maps the same way.
    assert type(from_status_value(code.value[0], "m")) is cls


def test_codes_we_never_send_are_internal() -> None:
    relayed = from_status(grpc.StatusCode.UNKNOWN, "stream reset")
    assert isinstance(relayed, InternalError)
    assert relayed.message == "UNKNOWN: stream reset"
    assert isinstance(from_status_value(999, "?"), InternalError)
