"""Chats on the gRPC API (generation.proto's `Chat`), on the path every chat takes.

In: the proto's messages, tools, tool choice and template variables become what the shared
chat path (gateway/chat_inputs.py) takes, and its errors, which use the OpenAI body's names,
are renamed to the proto's fields (`tools[0].function.parameters` ->
`chat.tools[0].parameters`). Out: each choice is read by the HTTP chat route's reader
(gateway/chat_output.py) into Choice.reasoning, the answer's text, and whole tool calls."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.chat_inputs import PreparedChat, prepare_chat, tool_chat_prompt
from gateway.chat_output import ChatOutput
from gateway.generation import GenerationCore
from gateway.generation_types import ChoiceUpdate, GenerationInput, Prompt
from gateway.tokenization import check_template_kwargs
from gateway.tools import ToolRequest, parse_tools
from llmserve.errors import FieldError
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import RequestLimits
from llmserve.v1 import generation_pb2

_MODES: dict[int, str | None] = {
    generation_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: None,
    generation_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    generation_pb2.TOOL_CHOICE_MODE_NONE: "none",
    generation_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}

# Names the shared chat path gives that are fields of `Chat`.
_CHAT_FIELD = re.compile(
    r"^(messages|tools|tool_choice|chat_template_kwargs|thinking_token_budget)\b"
)
# OpenAI nests a function's fields under `function`; the proto's Tool and ToolCall do not.
_FUNCTION = re.compile(r"^(tools\[\d+\]|messages\[\d+\]\.tool_calls\[\d+\])\.function\b")


@dataclass(frozen=True, slots=True)
class _ChatFields:
    """A Chat's fields as the shared chat path takes them, checked."""

    messages: list[dict[str, Any]]
    tools: ToolRequest | None
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]

    @classmethod
    def from_proto(cls, chat: generation_pb2.Chat, limits: RequestLimits) -> _ChatFields:
        tool_choice = _tool_choice(chat)
        tools = _tools(chat.tools)
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
        template_kwargs = _template_kwargs(chat.chat_template_kwargs)
        with _proto_names():
            request = parse_tools(tools, tool_choice, parallel, limits)
        return cls(
            _messages(chat),
            request,
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
            template_kwargs,
        )


async def prepared_chat(
    core: GenerationCore, chat: generation_pb2.Chat, grammar: GrammarSpec | None
) -> PreparedChat:
    """The chat's prompt and what reads its output; `grammar`: the request's own."""
    f = _ChatFields.from_proto(chat, core.limits)
    budget = chat.thinking_token_budget if chat.HasField("thinking_token_budget") else None
    with _proto_names():
        return await prepare_chat(
            core,
            f.messages,
            f.tools,
            grammar,
            f.add_generation_prompt,
            f.template_kwargs,
            budget,
        )


async def rendered_prompt(core: GenerationCore, chat: generation_pb2.Chat) -> Prompt:
    """The chat's prompt alone (Tokenize), rendered as Generate renders it."""
    f = _ChatFields.from_proto(chat, core.limits)
    with _proto_names():
        return await tool_chat_prompt(
            core, f.messages, f.tools, f.add_generation_prompt, f.template_kwargs
        )


class ChatChoices:
    """A chat request's choices as the HTTP chat route reads them: reasoning apart, tool calls
    read from the answer. A call goes out whole, once it is known to be complete: when the
    next call begins, or when its choice finishes."""

    def __init__(self, inp: GenerationInput, core: GenerationCore) -> None:
        self._inp, self._format = inp, core.tokenization.tool_format
        self._outputs: dict[int, ChatOutput] = {}
        self._calls_sent: dict[int, int] = {}

    @classmethod
    def needed(cls, inp: GenerationInput, core: GenerationCore) -> ChatChoices | None:
        """A reader for a chat whose output is parsed (reasoning or tools, and text to read:
        with detokenize false, nothing is)."""
        parsed = inp.reasoning is not None or inp.tools is not None
        return cls(inp, core) if parsed and inp.text.detokenize else None

    def fill(self, c: ChoiceUpdate, msg: generation_pb2.Choice) -> None:
        """Set `msg`'s text, reasoning and tool calls from the choice's update `c`."""
        output = self._outputs.get(c.index)
        if output is None:
            output = self._outputs[c.index] = ChatOutput(
                self._inp.reasoning, self._inp.tools, self._format
            )
        last = bool(c.finish_reason)
        d = output.feed_last(c.text, len(c.token_ids), last)
        msg.text, msg.reasoning = d.content, d.reasoning
        calls = output.calls
        whole = len(calls) if last else max(len(calls) - 1, 0)
        for call in calls[self._calls_sent.get(c.index, 0) : whole]:
            fn = call["function"]
            msg.tool_calls.add(id=call["id"], name=fn["name"], arguments=fn["arguments"])
        self._calls_sent[c.index] = whole

    @property
    def reasoning_tokens(self) -> int | None:
        """Output tokens spent reasoning, over the choices; None without a reasoning parser."""
        if self._inp.reasoning is None:
            return None
        return sum(o.reasoning_tokens for o in self._outputs.values())


# -- proto -> the shared chat path's inputs ------------------------------------------------------


def _messages(chat: generation_pb2.Chat) -> list[dict[str, Any]]:
    out = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _tools(tools: Iterable[generation_pb2.Tool]) -> list[dict[str, Any]] | None:
    """The tools in OpenAI's shape, which parse_tools checks."""
    out = []
    for i, t in enumerate(tools):
        fn = {"name": t.name, "description": t.description}
        if t.parameters:
            fn["parameters"] = _json(t.parameters, f"chat.tools[{i}].parameters")
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(chat: generation_pb2.Chat) -> str | dict[str, Any] | None:
    kind = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if kind == "function_name":
        return {"type": "function", "function": {"name": chat.tool_choice.function_name}}
    if kind is None:
        return None
    mode = chat.tool_choice.mode
    if mode not in _MODES:
        raise FieldError("chat.tool_choice.mode", f"unknown value {mode}")
    return _MODES[mode]


def _template_kwargs(text: str) -> dict[str, Any]:
    field = "chat.chat_template_kwargs"
    return check_template_kwargs(_json(text, field) if text else None, field)


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError(field, f"is not valid JSON: {exc}") from None


@contextlib.contextmanager
def _proto_names() -> Iterator[None]:
    """FieldErrors of the shared chat path, renamed to the proto's fields."""
    try:
        yield
    except FieldError as exc:
        raise FieldError(_proto_field(exc.field or "chat"), exc.detail) from exc


def _proto_field(name: str) -> str:
    if not _CHAT_FIELD.match(name):
        return name  # the request's own (`grammar`)
    if name == "tool_choice.function.name":
        return "chat.tool_choice.function_name"
    return "chat." + _FUNCTION.sub(r"\1", name)
