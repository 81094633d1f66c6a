"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat
route's request path. Content blocks are thinking (from the reasoning parser), text and
tool_use; streamed, they arrive as Anthropic's events (`message_start`, `content_block_*`,
`message_delta`, `message_stop`). Errors take Anthropic's shape (gateway/http_errors.py).
Stateless: every request carries its whole conversation."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway import metrics
from gateway.chat_inputs import tool_chat_prompt
from gateway.chat_output import ChatOutput
from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput
from gateway.http_errors import (
    anthropic_error_body,
    anthropic_error_responses,
    messages_responses,
)
from gateway.openai_protocol import ChatCompletionRequest
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
from gateway.sse import named_event
from gateway.tokenization import check_template_kwargs
from gateway.tools import parse_tools
from llmserve.errors import FieldError, string_field
from llmserve.grammar.reasoning import BUDGET_FIELD
from llmserve.telemetry import context_from_metadata
from llmserve.v1 import common_pb2

router = APIRouter()


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # llmserve's extension, as on the chat route.
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


# Chat request fields -> this request's names for them, for errors.
def _client_field(chat_field: str) -> str:
    if chat_field == "stop" or chat_field.startswith("stop["):
        return "stop_sequences" + chat_field.removeprefix("stop")
    if chat_field == BUDGET_FIELD:
        return "thinking.budget_tokens"
    return chat_field


def to_chat(body: _Conversation) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if body.system:
        text = body.system if isinstance(body.system, str) else _text(body.system, "system")
        messages.append({"role": "system", "content": text})
    for i, m in enumerate(body.messages):
        messages += _messages(m, f"messages[{i}]")
    kwargs = check_template_kwargs(body.chat_template_kwargs, "chat_template_kwargs")
    thinking = (body.thinking or {}).get("type")
    fields: dict[str, Any] = {}
    if thinking in ("enabled", "disabled"):
        kwargs.setdefault("enable_thinking", thinking == "enabled")
        budget = (body.thinking or {}).get("budget_tokens")
        if thinking == "enabled" and budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise FieldError("thinking.budget_tokens", "must be an integer of at least 0")
            # The scheduler's thinking budget: the block closes after this many tokens.
            fields["thinking_token_budget"] = budget
    elif body.thinking is not None:
        raise FieldError("thinking.type", "must be enabled or disabled")
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
        }
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,  # type: ignore[arg-type]
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=not (body.tool_choice or {}).get("disable_parallel_tool_use", False),
        chat_template_kwargs=kwargs,
        **fields,
    )


def _messages(m: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool turns."""
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise FieldError(f"{where}.role", "must be user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise FieldError(f"{where}.content", "must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(string_field(block, "text", at))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {})
            name = string_field(block, "name", at)
            fn = {"name": name, "arguments": arguments}
            calls.append({"id": string_field(block, "id", at), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{at}.content")
            tool_id = string_field(block, "tool_use_id", at)
            out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        elif kind not in ("thinking", "redacted_thinking"):
            raise FieldError(f"{at}.type", f"{kind!r} blocks are not supported in {role} turns")
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise FieldError(f"{where}[{j}].type", "only text blocks are supported here")
        texts.append(string_field(block, "text", f"{where}[{j}]"))
    return "".join(texts)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise FieldError(f"tools[{i}].type", "only client tools are supported")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise FieldError("tool_choice.type", "must be auto, any, tool or none")


@router.post(
    "/v1/messages/count_tokens",
    response_model=None,
    responses=anthropic_error_responses(400, 401, 404, 503),
)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    core: GenerationCore = request.app.state.core
    core.check_model(body.model)
    chat = to_chat(body)
    tools = parse_tools(chat.tools, chat.tool_choice, None, core.limits)
    messages = [_plain(m) for m in chat.model_dump()["messages"]]
    prompt = await tool_chat_prompt(core, messages, tools, True, chat.chat_template_kwargs)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    out = {"role": m["role"], "content": m["content"] or ""}
    for key in ("tool_calls", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    return out


@router.post(
    "/v1/messages",
    response_model=None,
    responses=messages_responses(dict),
)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    core: GenerationCore = request.app.state.core
    try:
        inp = await chat_input(core, to_chat(body))
    except FieldError as exc:
        raise FieldError(_client_field(exc.field or "body"), exc.detail) from exc
    metrics.REQUESTS.labels("messages", "stream" if body.stream else "full").inc()
    parent = context_from_metadata(list(request.headers.items()))
    run = _Run(core, inp)
    events = run.events(await first_update(core, inp, parent))
    if body.stream:
        return StreamingResponse(_sse(events), media_type="text/event-stream")
    try:
        async for _ in events:
            pass
    finally:
        await events.aclose()
    return JSONResponse(run.message())


async def _sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield named_event(event["type"], event)
    except Exception as exc:  # the status line is sent: the error travels as an event
        yield named_event("error", anthropic_error_body(exc))
    finally:
        await events.aclose()


# common.proto's FinishReason as Anthropic's stop_reason (a stop string: stop_sequence).
_STOP_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "end_turn",
    common_pb2.FINISH_REASON_LENGTH: "max_tokens",
    common_pb2.FINISH_REASON_IGNORED: "max_tokens",
    common_pb2.FINISH_REASON_ABORT: "end_turn",
}


class _Run:
    def __init__(self, core: GenerationCore, inp: GenerationInput) -> None:
        self.core = core
        self.id = f"msg_{uuid.uuid4().hex}"
        self.prompt_tokens = len(inp.prompt.token_ids)
        self.output = ChatOutput(inp.reasoning, inp.tools, core.tokenization.tool_format)
        self.items = OutputItems()
        self.outcome = Outcome()

    async def events(self, updates: Any) -> AsyncGenerator[dict[str, Any], None]:
        start = {**self.message(), "content": [], "stop_reason": None}
        # The prompt is counted before the first token, as Anthropic's message_start has it.
        start["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        yield {"type": "message_start", "message": start}
        async for e in item_events(updates, self.output, self.items, self.outcome):
            yield self._block_event(e)
        reason, sequence = self._stop()
        usage = self._usage()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield {"type": "message_delta", "delta": delta, "usage": usage}
        yield {"type": "message_stop"}

    def _block_event(self, e: ItemEvent) -> dict[str, Any]:
        if e.kind is EventKind.OPENED:
            block = _block(e.item, empty=True)
            return {"type": "content_block_start", "index": e.index, "content_block": block}
        if e.kind is EventKind.CLOSED:
            return {"type": "content_block_stop", "index": e.index}
        kind = e.item.kind
        if kind is ItemKind.REASONING:
            delta = {"type": "thinking_delta", "thinking": e.delta}
        elif kind is ItemKind.TEXT:
            delta = {"type": "text_delta", "text": e.delta}
        else:
            delta = {"type": "input_json_delta", "partial_json": e.delta}
        return {"type": "content_block_delta", "index": e.index, "delta": delta}

    def _stop(self) -> tuple[str | None, str | None]:
        # Calls end the turn only when the model stopped after them: a call cut off by
        # max_tokens is no call to run (the chat route's "tool_calls" rule).
        stopped = self.outcome.finish_reason == common_pb2.FINISH_REASON_STOP
        if stopped and any(i.kind is ItemKind.CALL for i in self.items.items):
            return "tool_use", None
        if isinstance(self.outcome.stop_reason, str):
            return "stop_sequence", self.outcome.stop_reason
        return _STOP_REASONS.get(self.outcome.finish_reason), None

    def _usage(self) -> dict[str, int]:
        usage = self.outcome.usage
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}

    def message(self) -> dict[str, Any]:
        reason, sequence = self._stop()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.core.model_name,
            "content": [_block(item) for item in self.items.items],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(),
        }


def _block(item: Item, empty: bool = False) -> dict[str, Any]:
    if item.kind is ItemKind.REASONING:
        # No signature: the thinking is the model's own text, not a sealed summary.
        return {"type": "thinking", "thinking": "" if empty else item.text, "signature": ""}
    if item.kind is ItemKind.TEXT:
        return {"type": "text", "text": "" if empty else item.text}
    arguments = {} if empty else item.arguments()
    return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": arguments}
