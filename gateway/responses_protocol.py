"""OpenAI's Responses API request (`POST /v1/responses`) and its translation into a chat
request: input items become chat messages, function tools become chat tools, `text.format`
becomes `response_format`. The chat request then takes the chat route's one validation path;
its errors are renamed to the fields this request has."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.openai_protocol import ChatCompletionRequest
from llmserve.errors import FieldError, string_field


class ResponsesRequest(BaseModel):
    # Fields OpenAI does not have are refused (400 naming the field), as OpenAI does.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    # Accepted and not acted on: they change nothing a model computes.
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extension, as on the chat route.
    chat_template_kwargs: dict[str, Any] | None = None


# Chat request fields -> this request's names for them, for errors.
_FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}


def client_field(chat_field: str) -> str:
    """The Responses field behind a chat request's field name (in a FieldError)."""
    head, sep, rest = chat_field.partition(".")
    base = head.split("[", 1)[0]
    if base == "messages":
        return "input"
    if base in _FIELD_NAMES:
        rest = rest.removeprefix("json_schema.").removeprefix("json_schema")
        return _FIELD_NAMES[base] + (sep + rest if rest else "")
    if base == "reasoning_effort":
        return "reasoning.effort"
    return chat_field


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request for `body`, after the stored conversation `history`."""
    messages = list(history)
    if body.instructions:
        # Instructions are not carried over from a previous response (OpenAI's rule).
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages += input_messages(body.input)
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_format(body.text),
        chat_template_kwargs=body.chat_template_kwargs,
        reasoning_effort=(body.reasoning or {}).get("effort"),
        stream=body.stream,
    )


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls become one assistant turn
    with tool_calls; reasoning items are dropped (templates render no past thinking)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": string_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": string_field(item, "name", where),
                    "arguments": string_field(item, "arguments", where),
                },
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": string_field(item, "call_id", where),
                    "content": text,
                }
            )
        elif kind != "reasoning":
            raise FieldError(f"{where}.type", f"{kind!r} items are not supported")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise FieldError(f"{where}.role", "must be user, assistant, system or developer")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_parts(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_parts(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise FieldError(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise FieldError(f"{where}[{j}].type", "only text parts are supported")
        texts.append(string_field(part, "text", f"{where}[{j}]"))
    return "".join(texts)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise FieldError(f"tools[{i}].type", "only function tools are supported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise FieldError("tool_choice.type", "must be function")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise FieldError("text.format.type", "must be text, json_schema or json_object")
