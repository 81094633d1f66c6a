"""ASGI middleware of the OpenAI-compatible API: API key and overload checks on /v1/ paths."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http_errors import error_response
from llmserve.errors import UnauthenticatedError, UnavailableError
from llmserve.security import KeySet


class InFlight:
    """Generation requests being answered, against the limit (--max-pending-requests)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0


class AuthAndLoad:
    """API key and overload checks for /v1/ paths, as plain ASGI: Starlette's
    `@app.middleware("http")` would relay every chunk of a streamed response through a memory
    stream and an extra task, which the gateway paid on each token."""

    def __init__(self, app: ASGIApp, api_keys: KeySet, in_flight: InFlight) -> None:
        self.app = app
        self.api_keys = api_keys  # empty: no key required
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if len(self.api_keys):
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) != 1 or not self.api_keys.accepts_authorization(given[0]):
                return error_response(
                    UnauthenticatedError("Incorrect or missing API key (Authorization: Bearer)")
                )
        if self.in_flight.count >= self.in_flight.limit:
            return error_response(UnavailableError("the server is overloaded; retry later"))
        return None
