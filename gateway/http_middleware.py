"""ASGI middleware of the OpenAI-compatible API: the API key check on /v1/ paths (the body
limit and admission are gateway.admission's)."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http_errors import error_response
from llmserve.errors import UnauthenticatedError
from llmserve.security import KeySet


class Auth:
    """The API key check for /v1/ paths, as plain ASGI: Starlette's
    `@app.middleware("http")` would relay every chunk of a streamed response through a memory
    stream and an extra task, which the gateway paid on each token."""

    def __init__(self, app: ASGIApp, api_keys: KeySet) -> None:
        self.app = app
        self.api_keys = api_keys  # empty: no key required

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
            # Anthropic's clients send the key as `x-api-key`: accepted the same way.
            keys = [v for k, v in scope["headers"] if k == b"x-api-key"]
            bearer = len(given) == 1 and self.api_keys.accepts_authorization(given[0])
            plain = len(keys) == 1 and self.api_keys.accepts(keys[0])
            if not (bearer or plain):
                return error_response(
                    UnauthenticatedError(
                        "Incorrect or missing API key (Authorization: Bearer, or x-api-key)"
                    ),
                    scope["path"],
                )
        return None
