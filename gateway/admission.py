"""The gateway's admission: an in-flight limit shared by HTTP and gRPC, and the drain on
shutdown.

A request holds a slot from admission until its response is complete (the last streamed chunk
included). Beyond `limit` slots a request is refused at once with `OverloadedError` (HTTP 429
with Retry-After, gRPC RESOURCE_EXHAUSTED); while draining, with `UnavailableError` (503,
UNAVAILABLE). `wait_idle()` lets shutdown wait for the requests in flight to finish.

`BodyLimitMiddleware` refuses HTTP bodies over a byte limit with 400 naming `body` before they are parsed,
and `AdmissionMiddleware` takes a slot for each generation request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from prometheus_client import Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http_errors import RETRY_AFTER_S, error_response
from llmserve.errors import ApiError, FieldError, OverloadedError, UnavailableError
from llmserve.logs import get_logger

log = get_logger(__name__)

IN_FLIGHT = Gauge(
    "llmserve_gateway_requests_in_flight", "Generation requests admitted and not yet complete"
)
# The scheduler client's per-request state (inboxes); back to 0 whenever nothing runs.
SCHEDULER_REQUESTS = Gauge(
    "llmserve_gateway_scheduler_requests", "Requests the gateway holds state for at the scheduler"
)


class Admission:
    """Counts requests in flight against a limit; refuses new ones once draining."""

    def __init__(self, limit: int, retry_after_s: float = RETRY_AFTER_S) -> None:
        if limit < 1:
            raise ValueError(f"max_pending_requests: must be at least 1, got {limit}")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        """Take a slot, or raise the refusal."""
        if self.draining:
            raise UnavailableError("the gateway is shutting down; retry on another replica")
        if self.in_flight >= self.limit:
            raise OverloadedError(
                f"the gateway has {self.in_flight} requests in flight, its limit "
                "(--max-pending-requests); retry later",
                self.retry_after_s,
            )
        self.in_flight += 1
        self._idle.clear()
        IN_FLIGHT.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        IN_FLIGHT.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        self.admit()
        try:
            yield
        finally:
            self.release()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`. True if none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


async def send_error(scope: Scope, receive: Receive, send: Send, exc: ApiError) -> None:
    """A refusal from inside ASGI middleware, in the shape of the API the path belongs to
    (Anthropic's on /v1/messages, OpenAI's elsewhere), as the routes' own errors are."""
    await error_response(exc, scope["path"])(scope, receive, send)


def _is_generation(scope: Scope) -> bool:
    return (
        scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/")
    )


class BodyLimitMiddleware:
    """Reads a POST body up to `max_bytes` before the app sees it; over that, 400 naming `body`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(scope, receive, send, self._too_large(int(declared)))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await send_error(scope, receive, send, self._too_large(size))
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    def _too_large(self, size: int) -> ApiError:
        return FieldError(
            "body",
            f"{size} bytes is over this server's limit of {self.max_bytes} (--max-body-bytes)",
        )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed


class AdmissionMiddleware:
    """Holds an admission slot for each generation request until its response is sent."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        try:
            self.admission.admit()
        except ApiError as exc:
            await send_error(scope, receive, send, exc)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release()
