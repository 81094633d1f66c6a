"""`POST /v1/responses`: OpenAI's Responses API over the chat route's request path.

A response's output items are reasoning, a message and function calls (gateway/
output_items.py); streamed, they arrive as the typed server-sent events the OpenAI SDK reads
(`response.created` ... `response.completed`). With `store` (OpenAI's default), the
conversation a response ends is kept in the gateway's memory, the last
`ResponseStore.max_entries` of them, so that a later request can continue it with
`previous_response_id`; nothing else is kept between requests."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway import metrics
from gateway.chat_output import ChatOutput
from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput
from gateway.http_errors import error_body, generation_responses
from gateway.openai_requests import chat_input
from gateway.output_items import (
    EventKind,
    Item,
    ItemEvent,
    ItemKind,
    Outcome,
    OutputItems,
    first_update,
    item_events,
)
from gateway.responses_protocol import ResponsesRequest, client_field, to_chat
from gateway.sse import named_event
from llmserve.errors import FieldError
from llmserve.telemetry import context_from_metadata
from llmserve.v1 import common_pb2

router = APIRouter()


class ResponseStore:
    """The conversations of stored responses (chat messages, the response's own output
    last), by response id; the oldest is dropped past `max_entries`."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._conversations: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        conversation = self._conversations.get(response_id)
        if conversation is None:
            raise FieldError(
                "previous_response_id",
                f"no stored response {response_id!r} (unknown, stored with store: false, or "
                f"evicted: the gateway keeps the last {self.max_entries} in memory)",
            )
        self._conversations.move_to_end(response_id)
        return list(conversation)

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.max_entries:
            self._conversations.popitem(last=False)


@router.post("/v1/responses", response_model=None, responses=generation_responses(dict))
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    core: GenerationCore = request.app.state.core
    store: ResponseStore = request.app.state.response_store
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    chat = to_chat(body, history)
    try:
        inp = await chat_input(core, chat)
    except FieldError as exc:
        raise FieldError(client_field(exc.field or "body"), exc.detail) from exc
    run = _Run(core, body, inp, chat.model_dump()["messages"], store)
    metrics.REQUESTS.labels("responses", "stream" if body.stream else "full").inc()
    parent = context_from_metadata(list(request.headers.items()))
    updates = await first_update(core, inp, parent)
    events = run.events(updates)
    if body.stream:
        return StreamingResponse(_sse(run, events), media_type="text/event-stream")
    try:
        async for _ in events:
            pass
    finally:
        await events.aclose()
    return JSONResponse(run.response())


async def _sse(run: _Run, events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield named_event(event["type"], event)
    except Exception as exc:  # the status line is sent: the error travels as an event
        body = error_body(exc)["error"]
        fields = {k: body[k] for k in ("code", "message", "param")}
        yield named_event("error", run.event("error", **fields))
    finally:
        await events.aclose()


class _Run:
    """One response: its items as they come, its events, and its whole body."""

    def __init__(
        self,
        core: GenerationCore,
        body: ResponsesRequest,
        inp: GenerationInput,
        messages: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.core, self.body, self.inp, self.messages = core, body, inp, messages
        self.store = store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.outcome = Outcome()
        self.status = "in_progress"
        self._item_ids: dict[int, str] = {}
        self._seq = 0

    async def events(self, updates: Any) -> AsyncGenerator[dict[str, Any], None]:
        output = ChatOutput(self.inp.reasoning, self.inp.tools, self.core.tokenization.tool_format)
        yield self.event("response.created", response=self.response())
        yield self.event("response.in_progress", response=self.response())
        async for e in item_events(updates, output, self.items, self.outcome):
            for event in self._item_event(e):
                yield event
        self.status = "completed" if self._complete() else "incomplete"
        if self.body.store:
            self.store.put(self.id, self.conversation())
        yield self.event(f"response.{self.status}", response=self.response())

    def _complete(self) -> bool:
        return self.outcome.finish_reason == common_pb2.FINISH_REASON_STOP

    def _item_status(self, index: int) -> str:
        """An item's status once closed: the one being written when the generation ended
        without stopping (max_output_tokens) is incomplete, a call's arguments cut short."""
        ended = self.outcome.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        cut_off = ended and not self._complete() and index == len(self.items.items) - 1
        return "incomplete" if cut_off else "completed"

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event of this response's stream, numbered in sending order."""
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _item_id(self, index: int, item: Item) -> str:
        if index not in self._item_ids:
            prefix = {ItemKind.REASONING: "rs", ItemKind.TEXT: "msg", ItemKind.CALL: "fc"}
            self._item_ids[index] = f"{prefix[item.kind]}_{uuid.uuid4().hex}"
        return self._item_ids[index]

    def _item_event(self, e: ItemEvent) -> list[dict[str, Any]]:
        item_id = self._item_id(e.index, e.item)
        at = {"item_id": item_id, "output_index": e.index}
        kind = e.item.kind
        if e.kind is EventKind.OPENED:
            added = self.event(
                "response.output_item.added",
                output_index=e.index,
                item=self._item(e.index, e.item, "in_progress", empty=True),
            )
            if kind is not ItemKind.TEXT:
                return [added]
            part = {"type": "output_text", "text": "", "annotations": []}
            return [
                added,
                self.event("response.content_part.added", **at, content_index=0, part=part),
            ]
        if e.kind is EventKind.DELTA:
            if kind is ItemKind.CALL:
                return [self.event("response.function_call_arguments.delta", **at, delta=e.delta)]
            name = "reasoning_text" if kind is ItemKind.REASONING else "output_text"
            extra: dict[str, Any] = {"logprobs": []} if kind is ItemKind.TEXT else {}
            return [
                self.event(f"response.{name}.delta", **at, content_index=0, delta=e.delta, **extra)
            ]
        out = []
        if kind is ItemKind.CALL:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **at,
                    name=e.item.name,
                    arguments=e.item.text,
                )
            )
        elif kind is ItemKind.REASONING:
            out.append(
                self.event("response.reasoning_text.done", **at, content_index=0, text=e.item.text)
            )
        else:
            text, part = e.item.text, _output_text(e.item.text)
            out.append(
                self.event(
                    "response.output_text.done", **at, content_index=0, text=text, logprobs=[]
                )
            )
            out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        item = self._item(e.index, e.item, self._item_status(e.index))
        out.append(self.event("response.output_item.done", output_index=e.index, item=item))
        return out

    def _item(self, index: int, item: Item, status: str, empty: bool = False) -> dict[str, Any]:
        item_id = self._item_id(index, item)
        if item.kind is ItemKind.CALL:
            return {
                "type": "function_call",
                "id": item_id,
                "call_id": item.call_id,
                "name": item.name,
                "arguments": "" if empty else item.text,
                "status": status,
            }
        if item.kind is ItemKind.REASONING:
            content = [] if empty else [{"type": "reasoning_text", "text": item.text}]
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content}
        return {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": status,
            "content": [] if empty else [_output_text(item.text)],
        }

    def response(self) -> dict[str, Any]:
        body, usage = self.body, self.outcome.usage
        incomplete = None
        if self.status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        done = self.status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.core.model_name,
            "output": [
                self._item(i, item, self._item_status(i)) for i, item in enumerate(self.items.items)
            ]
            if done
            else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "store": body.store,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.outcome.reasoning_tokens},
                "total_tokens": usage.total_tokens,
            }
            if done
            else None,
        }

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages this response ends: its request's, then its own answer."""
        text = "".join(i.text for i in self.items.items if i.kind is ItemKind.TEXT)
        calls = [
            {
                "id": i.call_id,
                "type": "function",
                "function": {"name": i.name, "arguments": i.text},
            }
            for i in self.items.items
            if i.kind is ItemKind.CALL
        ]
        answer: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            answer["tool_calls"] = calls
        return [*self.messages, answer]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
