"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health,
/ready, /metrics; /v1/responses, /v1/messages and /tokenize live in their own modules. Both generation routes go through the same GenerationCore as the gRPC API.

The routes are module functions; what they share (the core, the in-flight count, the
readiness probe) lives on `app.state`, set by `build_app`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import metrics
from gateway.admission import AdmissionMiddleware, BodyLimitMiddleware
from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput
from gateway.http_errors import error_responses, generation_responses, install_error_handlers
from gateway.http_middleware import Auth
from gateway.messages_api import router as messages_router
from gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthStatus,
    ModelList,
)
from gateway.openai_requests import chat_input, completion_inputs
from gateway.openai_responses import respond
from gateway.openai_shapers import ChatShaper, CompletionShaper, Shaper
from gateway.responses_api import ResponseStore
from gateway.responses_api import router as responses_router
from gateway.tokenize_api import router as tokenize_router
from llmserve.security import KeySet, installed
from llmserve.telemetry import context_from_metadata
from llmserve.tls import uvicorn_ssl

router = APIRouter()
_HEALTH: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthStatus},
    503: {"model": HealthStatus},
}


def build_app(
    core: GenerationCore,
    api_keys: KeySet | None = None,
    not_ready_reason: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The ASGI app. `not_ready_reason` answers /ready (None: ready); without it, /ready
    follows the scheduler connection."""
    app = FastAPI(
        title="llmserve",
        version="0.1.0",
        description="OpenAI-compatible API of the llmserve gateway",
    )
    app.state.core = core
    app.state.not_ready_reason = not_ready_reason or (
        lambda: None if core.scheduler.connected else "scheduler unavailable"
    )
    install_error_handlers(app)
    # Added last runs first: the key, then the body's size, then admission.
    app.add_middleware(AdmissionMiddleware, admission=core.admission)
    app.add_middleware(BodyLimitMiddleware, max_bytes=core.limits.max_body_bytes)
    app.add_middleware(Auth, api_keys=api_keys or KeySet())
    app.include_router(router)
    app.state.response_store = ResponseStore()
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(tokenize_router)
    return app


def _core(request: Request) -> GenerationCore:
    core: GenerationCore = request.app.state.core
    return core


@router.get("/health", response_model=None, responses=_HEALTH)
async def health() -> Response:
    # Liveness only: the process answers. Whether it can serve is /ready.
    return JSONResponse({"status": "ok"})


@router.get("/ready", response_model=None, responses=_HEALTH)
async def ready(request: Request) -> Response:
    reason = request.app.state.not_ready_reason()
    if reason is not None:
        return JSONResponse({"status": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
async def list_models(request: Request) -> dict[str, Any]:
    core = _core(request)
    return {
        "object": "list",
        "data": [
            {
                "id": core.model_name,
                "object": "model",
                "created": core.created,
                "owned_by": "llmserve",
                "max_model_len": core.max_model_len,
            }
        ],
    }


@router.post(
    "/v1/completions", response_model=None, responses=generation_responses(CompletionResponse)
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    core = _core(request)
    inputs = await completion_inputs(core, body)
    response_id = inputs[0].request_id.rsplit("-", 1)[0]
    shaper = CompletionShaper(core, response_id, int(time.time()), body.n, inputs, body.echo)
    return await _respond(request, body, inputs, shaper, "completions")


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=generation_responses(ChatCompletionResponse),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    core = _core(request)
    inp = await chat_input(core, body)
    shaper = ChatShaper(core, inp.request_id, int(time.time()), body.n, inp)
    return await _respond(request, body, [inp], shaper, "chat")


async def _respond(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    inputs: list[GenerationInput],
    shaper: Shaper,
    endpoint: str,
) -> Response:
    metrics.REQUESTS.labels(endpoint, "stream" if body.stream else "full").inc()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    parent = context_from_metadata(list(request.headers.items()))
    return await respond(
        _core(request), request, inputs, shaper, body.stream, include_usage, parent
    )


def http_server(
    core: GenerationCore, config: Any, not_ready_reason: Callable[[], str | None] | None = None
) -> Any:
    """The HTTP server (a `uvicorn.Server`: `serve()` runs it, `started` says it listens)."""
    import uvicorn

    app = build_app(core, config.api_keys, not_ready_reason)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.http_port,
            log_config=None,
            access_log=False,
            lifespan="off",
            **uvicorn_ssl(installed().tls, config.tls_require_client_cert),
        )
    )
    # The process owns SIGINT/SIGTERM (llmserve.service_main); uvicorn must not take them over.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    return server
