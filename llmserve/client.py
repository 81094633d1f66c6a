"""Python client for the public gRPC API (llmserve.v1.Generation), async and sync.

    async with AsyncClient("localhost:50051") as client:
        async for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")

    with Client("localhost:50051") as client:
        print(client.complete("Hello", max_tokens=16).text)

`api_key` is sent as `authorization: Bearer KEY` on every call; `tls` (llmserve.tls.ClientTls)
dials over TLS, with a client certificate when the gateway requires one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmserve.grammar.spec import GrammarSpec
from llmserve.grpc_utils import channel_options
from llmserve.proto_convert import finish_reason_name, grammar_to_proto, sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.security import SyncBearer, aio_bearer
from llmserve.tls import ClientTls
from llmserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass(slots=True)
class Chunk:
    """New output of one choice."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass(slots=True)
class Completion:
    """A finished request: every choice's whole text, plus usage."""

    choices: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.choices[0]


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    request_id: str = "",
    model: str = "",
    echo: bool = False,
    priority: int = 0,
    grammar: GrammarSpec | None = None,
    **sampling: Any,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a text prompt, token ids or chat messages, and SamplingParams
    keywords (temperature, max_tokens, n, seed, ...). max_tokens defaults to the context left.
    `priority`: lower is served first. `grammar`: what the output must match."""
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        stop=list(stop),
        include_stop_str_in_output=include_stop_str_in_output,
        echo=echo,
        priority=priority,
    )
    if messages is not None:
        request.chat.messages.extend(
            generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    else:
        raise ValueError("prompt: give a prompt (text or token ids) or messages")
    has_max_tokens = "max_tokens" in sampling
    params = sampling_params_to_proto(SamplingParams(**sampling))
    if not has_max_tokens:
        params.ClearField("max_tokens")
    request.sampling_params.CopyFrom(params)
    if grammar is not None:
        request.grammar.CopyFrom(grammar_to_proto(grammar))
    return request


def _chunks(response: generation_pb2.GenerateResponse) -> list[Chunk]:
    return [
        Chunk(c.index, c.text, list(c.token_ids), finish_reason_name(c.finish_reason))
        for c in response.choices
    ]


class _Collector:
    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage = (0, 0)

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        for chunk in _chunks(response):
            self.texts.setdefault(chunk.index, []).append(chunk.text)
            self.ids.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.finish_reason:
                self.finish[chunk.index] = chunk.finish_reason
        if response.HasField("usage"):
            self.usage = (response.usage.prompt_tokens, response.usage.completion_tokens)

    def result(self) -> Completion:
        keys = sorted(self.texts)
        return Completion(
            ["".join(self.texts[k]) for k in keys],
            [self.ids[k] for k in keys],
            [self.finish.get(k) for k in keys],
            *self.usage,
        )


class AsyncClient:
    def __init__(
        self,
        address: str = "localhost:50051",
        *,
        timeout_s: float | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        api_key: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        options = channel_options(max_message_bytes)
        interceptors = aio_bearer(api_key) if api_key else []
        self._channel = (
            grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
            if tls is None
            else grpc.aio.secure_channel(
                address, tls.credentials(), options=options, interceptors=interceptors
            )
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(
        self, request: generation_pb2.GenerateRequest
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        call = self._stub.Generate(request, timeout=self.timeout_s)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op when finished; aborts the request otherwise

    async def generate(
        self, prompt: str | Sequence[int] | None = None, **kwargs: Any
    ) -> AsyncIterator[Chunk]:
        async for response in self.stream(build_request(prompt, **kwargs)):
            for chunk in _chunks(response):
                yield chunk

    async def complete(
        self, prompt: str | Sequence[int] | None = None, **kwargs: Any
    ) -> Completion:
        collector = _Collector()
        async for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
        return collector.result()

    async def tokenize(self, text: str) -> list[int]:
        reply = await self._stub.Tokenize(
            generation_pb2.TokenizeRequest(text=text), timeout=self.timeout_s
        )
        return list(reply.token_ids)

    async def list_models(self) -> list[str]:
        reply = await self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=self.timeout_s
        )
        return [m.id for m in reply.models]


class Client:
    """Blocking client over the same API."""

    def __init__(
        self,
        address: str = "localhost:50051",
        *,
        timeout_s: float | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        api_key: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        options = channel_options(max_message_bytes)
        channel = (
            grpc.insecure_channel(address, options=options)
            if tls is None
            else grpc.secure_channel(address, tls.credentials(), options=options)
        )
        self._channel = grpc.intercept_channel(channel, SyncBearer(api_key)) if api_key else channel
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self.timeout_s = timeout_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(
        self, request: generation_pb2.GenerateRequest
    ) -> Iterator[generation_pb2.GenerateResponse]:
        call = self._stub.Generate(request, timeout=self.timeout_s)
        try:
            yield from call
        finally:
            call.cancel()

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Iterator[Chunk]:
        for response in self.stream(build_request(prompt, **kwargs)):
            yield from _chunks(response)

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        collector = _Collector()
        for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
        return collector.result()

    def tokenize(self, text: str) -> list[int]:
        reply = self._stub.Tokenize(
            generation_pb2.TokenizeRequest(text=text), timeout=self.timeout_s
        )
        return list(reply.token_ids)
