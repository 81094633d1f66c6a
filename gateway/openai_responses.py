"""Answering a generation route: run its inputs (one per prompt) through GenerationCore and
send the shaped result, whole or as server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.generation import GenerationCore
from gateway.generation_types import ChoiceUpdate, GenerationInput, GenerationUpdate, Usage
from gateway.http_errors import error_body
from gateway.openai_shapers import PromptLogprobs, Shaper
from gateway.sse import DONE, data_event


async def respond(
    core: GenerationCore,
    request: Request,
    inputs: list[GenerationInput],
    shaper: Shaper,
    stream: bool,
    include_usage: bool,
    parent: Any,
) -> Response:
    """The whole response, or a stream of chunks; a client that disconnects aborts."""
    if stream:
        updates = _merged(core, inputs, parent)
        # The first update decides the status: a refusal (the scheduler's queue is full: 429)
        # or another error before any token is an HTTP error, not an event after a 200.
        try:
            first = await anext(updates)
        except BaseException:
            await updates.aclose()
            raise
        return StreamingResponse(
            _stream(_prepend(first, updates), shaper, include_usage),
            media_type="text/event-stream",
        )
    collect = asyncio.create_task(_collect(core, inputs, parent, shaper))
    while not collect.done():
        done, _ = await asyncio.wait({collect}, timeout=1.0)
        if not done and await request.is_disconnected():
            collect.cancel()  # closes the generators: the requests are aborted
            await asyncio.gather(collect, return_exceptions=True)
            return Response(status_code=499)
    return JSONResponse(collect.result())


async def _prepend(
    first: tuple[int, GenerationUpdate], rest: AsyncGenerator[tuple[int, GenerationUpdate], None]
) -> AsyncGenerator[tuple[int, GenerationUpdate], None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _collect(
    core: GenerationCore, inputs: list[GenerationInput], parent: Any, shaper: Shaper
) -> dict[str, Any]:
    choices: dict[int, list[ChoiceUpdate]] = {}
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    usage = Usage(0, 0)
    async for i, update in _merged(core, inputs, parent):
        if update.prompt_logprobs is not None:
            prompt_logprobs[i] = update.prompt_logprobs
        for c in update.choices:
            choices.setdefault(i * shaper.n + c.index, []).append(c)
        usage = _add(usage, update)
    return shaper.full(choices, prompt_logprobs, usage)


async def _stream(
    updates: AsyncGenerator[tuple[int, GenerationUpdate], None], shaper: Shaper, include_usage: bool
) -> AsyncIterator[bytes]:
    usage = Usage(0, 0)
    try:
        async for i, update in updates:
            for chunk in shaper.chunks(i, update.choices, update.prompt_logprobs, include_usage):
                yield data_event(chunk)
            usage = _add(usage, update)
        if include_usage:
            yield data_event(shaper.usage_chunk(usage))
    except Exception as exc:  # the status line is sent: the error travels as an event
        yield data_event(error_body(exc))
    finally:
        await updates.aclose()
    yield DONE


def _add(total: Usage, update: GenerationUpdate) -> Usage:
    return total if update.usage is None else total + update.usage


async def _merged(
    core: GenerationCore, inputs: list[GenerationInput], parent: Any
) -> AsyncGenerator[tuple[int, GenerationUpdate], None]:
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
