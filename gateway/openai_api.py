"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health,
/ready, /metrics. Both endpoints go through the same GenerationCore as the gRPC API."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import metrics
from gateway.generation import (
    ChoiceUpdate,
    GenerationCore,
    GenerationInput,
    GenerationUpdate,
    LogprobEntry,
    Prompt,
    TextOptions,
)
from gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    HealthStatus,
    ModelList,
)
from llmserve.grpc_utils import RequestError, invalid_argument, status_for
from llmserve.sampling_params import SamplingParams, SamplingParamsError
from llmserve.security import KeySet, installed
from llmserve.telemetry import context_from_metadata
from llmserve.tls import uvicorn_ssl

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _from_exception(exc: BaseException) -> JSONResponse:
    code, message = status_for(exc)
    status, kind = _HTTP_STATUS.get(code, (500, "internal_error"))
    param = getattr(exc, "field", None)
    if isinstance(exc, SamplingParamsError):
        param = exc.field
    return error_response(status, message, kind, param,
                          "model_not_found" if code == grpc.StatusCode.NOT_FOUND else None)


class _Overload:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0


class _AuthAndLoad:
    """API key and overload checks for /v1/ paths, as plain ASGI: Starlette's
    `@app.middleware("http")` would relay every chunk of a streamed response through a memory
    stream and an extra task, which the gateway paid on each token."""

    def __init__(self, app: ASGIApp, api_keys: KeySet, overload: _Overload) -> None:
        self.app = app
        self.api_keys = api_keys
        self.overload = overload

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
                return error_response(401, "Incorrect or missing API key (Authorization: Bearer)",
                                      "invalid_request_error", None, "invalid_api_key")
        if self.overload.in_flight >= self.overload.limit:
            return error_response(503, "the server is overloaded; retry later",
                                  "service_unavailable")
        return None


def build_app(core: GenerationCore, api_keys: KeySet | None = None,
              max_pending_requests: int = 1024,
              not_ready_reason: Callable[[], str | None] | None = None) -> FastAPI:
    app = FastAPI(title="llmserve", version="0.1.0",
                  description="OpenAI-compatible API of the llmserve gateway")
    overload = _Overload(max_pending_requests)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = _param_name(first.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              "invalid_request_error", param)

    # Client mistakes are answered by the inner exception middleware. A handler registered for
    # `Exception` alone runs in Starlette's outermost middleware, which re-raises after
    # answering: every 400 was logged as a crash and the connection could be reset.
    @app.exception_handler(RequestError)
    @app.exception_handler(SamplingParamsError)
    async def _client_error(request: Request, exc: Exception) -> JSONResponse:
        return _from_exception(exc)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return _from_exception(exc)

    app.add_middleware(_AuthAndLoad, api_keys=api_keys or KeySet(), overload=overload)

    @app.get("/health", response_model=None,
             responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus}})
    async def health() -> Response:
        # Liveness only: the process answers. Whether it can serve is /ready.
        return JSONResponse({"status": "ok"})

    @app.get("/ready", response_model=None,
             responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus}})
    async def ready() -> Response:
        if not_ready_reason is None:
            reason = None if core.scheduler.connected else "scheduler unavailable"
        else:
            reason = not_ready_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401, 503))
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": core.model_name, "object": "model", "created": core.created,
            "owned_by": "llmserve", "max_model_len": core.max_model_len,
        }]}

    @app.post("/v1/completions", response_model=None,
              responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        core.check_model(body.model)
        if body.suffix:
            raise invalid_argument("suffix", "is not supported")
        prompts = _completion_prompts(core, body.prompt)
        inputs = []
        for i, prompt in enumerate(prompts):
            params = _sampling_params(core, body, prompt, body.max_tokens, "max_tokens",
                                      body.logprobs,
                                      body.logprobs if body.echo and body.logprobs is not None
                                      else None)
            inputs.append(GenerationInput(f"cmpl-{uuid.uuid4().hex}-{i}", prompt, params,
                                          _text_options(body), "text_completion"))
        return await _respond(core, overload, request, body, inputs, chat=False)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        core.check_model(body.model)
        if body.tools:
            raise invalid_argument("tools", "tool calling is not supported")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise invalid_argument("response_format", "only {'type': 'text'} is supported")
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in body.messages
        ]
        prompt = core.prompt_from_chat(messages, body.add_generation_prompt, "messages")
        max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = body.max_tokens, "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_argument("top_logprobs", "needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(core, body, prompt, max_tokens, field, logprobs, None)
        inp = GenerationInput(f"chatcmpl-{uuid.uuid4().hex}", prompt, params,
                              _text_options(body), "chat")
        return await _respond(core, overload, request, body, [inp], chat=True)

    _drop_default_422(app)
    return app


# -- OpenAPI document -------------------------------------------------------------------------


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERROR_TEXT[status]}
            for status in statuses}


_ERROR_TEXT = {
    400: "Invalid request; `error.param` names the field",
    401: "Missing or wrong API key (with --api-key)",
    404: "The model is not served here",
    409: "A request with this id is already running",
    429: "Too many requests",
    503: "Overloaded (--max-pending-requests) or the scheduler is unavailable",
}


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok: dict[int | str, dict[str, Any]] = {200: {
        "model": model,
        "description": "The full response, or with `stream: true` server-sent events "
                       "(`data: <chunk>` lines, then `data: [DONE]`)",
        # Before OpenAPI 3.2 the schema of an event stream describes one event.
        "content": {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string",
                                    "description": "a JSON chunk, an error, or [DONE]"}},
        }}},
    }}
    return {**ok, **_errors(400, 401, 404, 409, 429, 503)}


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


# -- request building ------------------------------------------------------------------------


def _param_name(loc: Any) -> str | None:
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
        elif isinstance(part, str) and part.isidentifier() and part.islower() and \
                part not in _TYPE_TAGS:
            name += f".{part}" if name else part
        else:
            break
    return name or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _completion_prompts(core: GenerationCore, prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str):
        return [core.prompt_from_text(prompt)]
    if not prompt:
        raise invalid_argument("prompt", "must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [core.prompt_from_ids(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [core.prompt_from_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [core.prompt_from_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise invalid_argument("prompt", "must be a string, a list of strings, or token ids")


def _text_options(body: CompletionRequest | ChatCompletionRequest) -> TextOptions:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise invalid_argument("stop", "stop strings must not be empty")
    return TextOptions(tuple(stop), body.include_stop_str_in_output, body.skip_special_tokens)


def _sampling_params(
    core: GenerationCore,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: Prompt,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    if body.logit_bias:
        raise invalid_argument("logit_bias", "is not supported")
    if max_tokens is None:
        max_tokens = core.max_tokens_left(prompt)
    top_k = body.top_k or 0
    if top_k == -1:
        top_k = 0
    kwargs: dict[str, Any] = {
        "n": body.n, "best_of": body.best_of, "use_beam_search": body.use_beam_search,
        "length_penalty": body.length_penalty,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": top_k,
        "min_p": body.min_p or 0.0,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": body.repetition_penalty or 1.0,
        "seed": body.seed, "max_tokens": max_tokens, "min_tokens": body.min_tokens,
        "stop_token_ids": tuple(body.stop_token_ids or ()), "ignore_eos": body.ignore_eos,
        "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
    }
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        name = exc.field
        if name == "max_tokens":
            name = max_tokens_field
        elif name == "best_of" and body.best_of is None:
            name = "n"  # best_of defaults to n; the client only sent n
        elif name == "logprobs" and isinstance(body, ChatCompletionRequest):
            name = "top_logprobs"
        raise invalid_argument(name, str(exc).split(": ", 1)[-1]) from exc
    core.check_max_tokens(prompt, params.max_tokens, max_tokens_field)
    return params


# -- responses ---------------------------------------------------------------------------------


async def _merged(core: GenerationCore, inputs: list[GenerationInput], parent: Any
                  ) -> AsyncIterator[tuple[int, GenerationUpdate]]:
    """Updates of several requests (one per prompt) as they come, tagged with the prompt index."""
    if len(inputs) == 1:
        async for update in core.generate(inputs[0], parent):
            yield 0, update
        return
    queue: asyncio.Queue[tuple[int, GenerationUpdate | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, inp: GenerationInput) -> None:
        try:
            async for update in core.generate(inp, parent):
                queue.put_nowait((i, update))
            queue.put_nowait((i, None))
        except BaseException as exc:  # delivered to the consumer, then re-raised there
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _respond(core: GenerationCore, overload: _Overload, request: Request,
                   body: CompletionRequest | ChatCompletionRequest,
                   inputs: list[GenerationInput], chat: bool) -> Response:
    parent = context_from_metadata(list(request.headers.items()))
    response_id = inputs[0].request_id.rsplit("-", 1)[0] if not chat else inputs[0].request_id
    created = int(time.time())
    n = body.n
    shaper = _ChatShaper(core, response_id, created) if chat else _CompletionShaper(
        core, response_id, created, inputs, echo=getattr(body, "echo", False))
    metrics.REQUESTS.labels("chat" if chat else "completions", "stream" if body.stream
                            else "full").inc()
    overload.in_flight += 1
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(core, overload, inputs, parent, shaper, n, include_usage),
            media_type="text/event-stream",
        )
    try:
        collect = asyncio.create_task(_collect(core, inputs, parent, shaper, n))
        while not collect.done():
            done, _ = await asyncio.wait({collect}, timeout=1.0)
            if not done and await request.is_disconnected():
                collect.cancel()  # closes the generators: the requests are aborted
                await asyncio.gather(collect, return_exceptions=True)
                return Response(status_code=499)
        return JSONResponse(collect.result())
    finally:
        overload.in_flight -= 1


async def _collect(core: GenerationCore, inputs: list[GenerationInput], parent: Any,
                   shaper: _Shaper, n: int) -> dict[str, Any]:
    choices: dict[int, list[ChoiceUpdate]] = {}
    prompt_logprobs: dict[int, list[LogprobEntry | None]] = {}
    usage = [0, 0]
    async for i, update in _merged(core, inputs, parent):
        if update.prompt_logprobs is not None:
            prompt_logprobs[i] = update.prompt_logprobs
        for c in update.choices:
            choices.setdefault(i * n + c.index, []).append(c)
        if update.usage is not None:
            usage[0] += update.usage.prompt_tokens
            usage[1] += update.usage.completion_tokens
    return shaper.full(choices, prompt_logprobs, n, usage)


async def _stream(core: GenerationCore, overload: _Overload, inputs: list[GenerationInput],
                  parent: Any, shaper: _Shaper, n: int, include_usage: bool
                  ) -> AsyncIterator[str]:
    usage = [0, 0]
    try:
        async for i, update in _merged(core, inputs, parent):
            for chunk in shaper.chunks(i, n, update, include_usage):
                yield f"data: {json.dumps(chunk)}\n\n"
            if update.usage is not None:
                usage[0] += update.usage.prompt_tokens
                usage[1] += update.usage.completion_tokens
        if include_usage:
            yield f"data: {json.dumps(shaper.usage_chunk(usage))}\n\n"
        yield "data: [DONE]\n\n"
    except RequestError as exc:
        error = json.loads(bytes(_from_exception(exc).body))
        yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        overload.in_flight -= 1


def _usage(usage: list[int]) -> dict[str, int]:
    return {"prompt_tokens": usage[0], "completion_tokens": usage[1],
            "total_tokens": usage[0] + usage[1]}


class _Shaper(abc.ABC):
    """Turns generation updates into one endpoint's response and chunk shapes."""

    object_name = ""
    chunk_name = ""

    def __init__(self, core: GenerationCore, response_id: str, created: int) -> None:
        self.core, self.id, self.created = core, response_id, created

    def envelope(self, name: str) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created,
                "model": self.core.model_name}

    def usage_chunk(self, usage: list[int]) -> dict[str, Any]:
        return {**self.envelope(self.chunk_name), "choices": [], "usage": _usage(usage)}

    @abc.abstractmethod
    def chunks(self, i: int, n: int, update: GenerationUpdate, include_usage: bool
               ) -> list[dict[str, Any]]:
        """SSE chunks for one update of prompt `i`."""

    @abc.abstractmethod
    def full(self, choices: dict[int, list[ChoiceUpdate]],
             prompt_logprobs: dict[int, list[LogprobEntry | None]], n: int, usage: list[int]
             ) -> dict[str, Any]:
        """The non-streaming response body."""


class _CompletionShaper(_Shaper):
    object_name = chunk_name = "text_completion"

    def __init__(self, core: GenerationCore, response_id: str, created: int,
                 inputs: list[GenerationInput], echo: bool) -> None:
        super().__init__(core, response_id, created)
        self.inputs, self.echo = inputs, echo
        self.echoed: set[int] = set()
        self.offsets: dict[int, int] = {}

    def _logprobs(self, key: int, entries: list[LogprobEntry | None]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        offset = self.offsets.get(key, 0)
        for entry in entries:
            if entry is None:  # the first prompt token has no logprob
                out["tokens"].append(None)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                out["text_offset"].append(offset)
                continue
            out["tokens"].append(entry.token.text)
            out["token_logprobs"].append(entry.token.logprob)
            out["top_logprobs"].append({t.text: t.logprob for t in entry.top} or None)
            out["text_offset"].append(offset)
            offset += len(entry.token.text)
        self.offsets[key] = offset
        return out

    def _prefix(self, i: int, key: int, prompt_lp: list[LogprobEntry | None] | None
                ) -> tuple[str, list[LogprobEntry | None]]:
        if not self.echo or key in self.echoed:
            return "", []
        self.echoed.add(key)
        prompt = self.inputs[i].prompt
        text = prompt.text if prompt.text is not None else \
            self.core.tokenization.tokenizer.decode(prompt.token_ids)
        return text, list(prompt_lp or [])

    def _choice(self, key: int, text: str, c_logprobs: list[LogprobEntry] | None,
                prompt_entries: list[LogprobEntry | None], finish: str | None,
                stop_reason: Any) -> dict[str, Any]:
        lp = None
        if c_logprobs is not None or prompt_entries:
            lp = self._logprobs(key, [*prompt_entries, *(c_logprobs or [])])
        return {"index": key, "text": text, "logprobs": lp,
                "finish_reason": _openai_finish(finish), "stop_reason": stop_reason}

    def chunks(self, i: int, n: int, update: GenerationUpdate, include_usage: bool
               ) -> list[dict[str, Any]]:
        out = []
        for c in update.choices:
            key = i * n + c.index
            prefix, entries = self._prefix(i, key, update.prompt_logprobs)
            choice = self._choice(key, prefix + c.text, c.logprobs, entries, c.finish_reason,
                                  c.stop_reason)
            chunk = {**self.envelope(self.chunk_name), "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def full(self, choices: dict[int, list[ChoiceUpdate]],
             prompt_logprobs: dict[int, list[LogprobEntry | None]], n: int, usage: list[int]
             ) -> dict[str, Any]:
        result = []
        for key in sorted(choices):
            parts = choices[key]
            i = key // n
            prefix, entries = self._prefix(i, key, prompt_logprobs.get(i))
            lps = None if all(p.logprobs is None for p in parts) else \
                [e for p in parts for e in (p.logprobs or [])]
            last = parts[-1]
            result.append(self._choice(key, prefix + "".join(p.text for p in parts), lps,
                                       entries, last.finish_reason, last.stop_reason))
        return {**self.envelope(self.object_name), "choices": result, "usage": _usage(usage)}


class _ChatShaper(_Shaper):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, core: GenerationCore, response_id: str, created: int) -> None:
        super().__init__(core, response_id, created)
        self.started: set[int] = set()

    @staticmethod
    def _logprobs(entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def token(t: Any) -> dict[str, Any]:
            return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}

        return {"content": [
            {**token(e.token), "top_logprobs": [token(t) for t in e.top]} for e in entries
        ]}

    def chunks(self, i: int, n: int, update: GenerationUpdate, include_usage: bool
               ) -> list[dict[str, Any]]:
        out = []
        for c in update.choices:
            delta: dict[str, Any] = {}
            if c.index not in self.started:
                self.started.add(c.index)
                delta["role"] = "assistant"
            if c.text or not c.finish_reason:
                delta["content"] = c.text
            choice = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c.logprobs),
                      "finish_reason": _openai_finish(c.finish_reason),
                      "stop_reason": c.stop_reason}
            chunk = {**self.envelope(self.chunk_name), "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def full(self, choices: dict[int, list[ChoiceUpdate]],
             prompt_logprobs: dict[int, list[LogprobEntry | None]], n: int, usage: list[int]
             ) -> dict[str, Any]:
        result = []
        for key in sorted(choices):
            parts = choices[key]
            lps = None if all(p.logprobs is None for p in parts) else \
                [e for p in parts for e in (p.logprobs or [])]
            result.append({
                "index": key,
                "message": {"role": "assistant", "content": "".join(p.text for p in parts)},
                "logprobs": self._logprobs(lps),
                "finish_reason": _openai_finish(parts[-1].finish_reason),
                "stop_reason": parts[-1].stop_reason,
            })
        return {**self.envelope(self.object_name), "choices": result, "usage": _usage(usage)}


def _openai_finish(reason: str | None) -> str | None:
    # OpenAI has no "abort"; a request only ends that way when its client went away.
    return reason


async def serve_http(core: GenerationCore, config: Any,
                     not_ready_reason: Callable[[], str | None] | None = None) -> None:
    import uvicorn

    app = build_app(core, config.api_keys, config.max_pending_requests, not_ready_reason)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.http_port, log_config=None, access_log=False,
        lifespan="off",
        **uvicorn_ssl(installed().tls, config.tls_require_client_cert),
    ))
    # The process owns SIGINT/SIGTERM (llmserve.service_main); uvicorn must not take them over.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    await server.serve()
