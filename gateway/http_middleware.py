"""ASGI middleware of the OpenAI-compatible API: API key and overload checks on /v1/ paths."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http_errors import error_response
from llmserve.errors import UnauthenticatedError, UnavailableError


class InFlight:
    """Generation requests being answered, against the limit (--max-pending-requests)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0


class AuthAndLoad:
    """API key and overload checks for /v1/ paths, as plain ASGI: Starlette's
    `@app.middleware("http")` would relay every chunk of a streamed response through a memory
    stream and an extra task, which the gateway paid on each token."""

    def __init__(self, app: ASGIApp, api_key: str | None, in_flight: InFlight) -> None:
        self.app = app
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self.authorization is not None:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if given != [self.authorization]:
                return error_response(
                    UnauthenticatedError("Incorrect or missing API key (Authorization: Bearer)")
                )
        if self.in_flight.count >= self.in_flight.limit:
            return error_response(UnavailableError("the server is overloaded; retry later"))
        return None
