"""The contract of a tool-call format, and the pieces its parsers share.

A format says three things: how a chat with tools is rendered (`render`), which grammar the
output must follow (`grammar`), and how the output text is cut into content and calls
(`parser`: incremental, for streaming; the whole text is the same parser fed once).
"""

from __future__ import annotations

import abc
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway.tools import Tool, ToolRequest
from llmserve.errors import FieldError
from llmserve.grammar.spec import GrammarSpec

# The request field a tool grammar's errors name.
TOOLS_FIELD = "tools"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a streamed call: its header (id and name, once) or an argument
    fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class CallParser(abc.ABC):
    """Cuts one choice's output into content and tool calls as it grows. `calls` holds the
    calls so far in OpenAI's `message.tool_calls` form."""

    calls: list[dict[str, Any]]

    @abc.abstractmethod
    def feed(self, new: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas that `new` completes (text that may still turn out
        to be part of a call is held back)."""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: what was held back, as content."""
        return "", []


class ToolFormat(abc.ABC):
    """One way of asking a model for tool calls and reading them back."""

    name: str

    @abc.abstractmethod
    def render(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages to give the chat template, and its `tools=` argument (None: the
        template is not given tools)."""

    @abc.abstractmethod
    def grammar(self, request: ToolRequest) -> GrammarSpec:
        """What the output must match: calls only for `required` and a named function, a
        call or a text answer for `auto`."""

    @abc.abstractmethod
    def parser(self) -> CallParser:
        """A parser for one choice's output."""


# -- grammar pieces ---------------------------------------------------------------------------


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, in this order."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def call_schemas(request: ToolRequest, arguments_key: str) -> list[dict[str, Any]]:
    """`{"name": <tool>, <arguments_key>: <its parameters>}` for each tool the request may
    call (the named one only, for a named tool_choice)."""
    return [
        object_schema({"name": {"const": t.name}, arguments_key: t.parameters})
        for t in request.tools
        if not request.named or t.name == request.choice
    ]


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema`, in the backend's fixed JSON layout (the parsers
    rely on it as much as the JSON_SCHEMA grammars do)."""
    # Imported here: the flag's choices (`llmserve up`) need this package, not llguidance.
    from llmserve.grammar.llguidance_backend import JSON_OPTIONS

    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def lark_string(text: str) -> str:
    return json.dumps(text)


def text_without(marker: str) -> str:
    """A regular expression for any text in which `marker` does not occur.

    Built for a marker whose proper prefixes are never also its suffixes (`<tool_call>`):
    outside a partial marker any character but its first is free; a partial marker is either
    followed by a character that breaks it, or by the start of another partial marker, or
    by the end of the text."""
    assert len(marker) > 1 and all(
        not marker.endswith(marker[:i]) for i in range(1, len(marker))
    ), marker

    def esc(text: str) -> str:
        return "".join("\\" + c if c in _REGEX_META else c for c in text)

    def cls_not(*chars: str) -> str:
        return "[^" + esc("".join(chars)) + "]"

    first = marker[0]
    partial = "(?:" + "|".join(esc(marker[:i]) for i in range(1, len(marker))) + ")"
    breaks = "|".join(esc(marker[:i]) + cls_not(marker[i], first) for i in range(1, len(marker)))
    return f"(?:{cls_not(first)}|{partial}*(?:{breaks}))*{partial}*"


# Characters a regular expression (and a Lark /.../ literal) needs escaped.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


# -- parsing pieces ---------------------------------------------------------------------------


class Scan(Enum):
    MORE = "more"  # the text so far could still match: wait for more
    NO = "no"  # it cannot match


@dataclass(frozen=True, slots=True)
class Header:
    """A call's start, up to its arguments: the tool's name, and where the arguments
    object begins."""

    name: str
    end: int


def scan_header(text: str, pos: int, keys: tuple[str, ...]) -> Header | Scan:
    """Match `{"name": "<name>", "<key>": ` followed by `{`, with any whitespace between the
    pieces, at `pos`; `keys` are the names the arguments may go by."""
    i = pos
    for piece in ("{", '"name"', ":", None, ",", keys, ":"):
        i = _skip_space(text, i)
        if i == len(text):
            return Scan.MORE
        if piece is None:  # the name, a JSON string
            got = _scan_string(text, i)
            if not isinstance(got, int):
                return got
            try:
                name = json.loads(text[i:got])
            except json.JSONDecodeError:
                return Scan.NO
            i = got
            continue
        options = (piece,) if isinstance(piece, str) else tuple(f'"{k}"' for k in piece)
        got = _scan_literal(text, i, options)
        if not isinstance(got, int):
            return got
        i = got
    i = _skip_space(text, i)
    if i == len(text):
        return Scan.MORE
    return Header(name, i) if text[i] == "{" else Scan.NO


def scan_literal(text: str, pos: int, literal: str) -> int | Scan:
    """The end of `literal` at `pos` (after any whitespace)."""
    return _scan_literal(text, _skip_space(text, pos), (literal,))


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _scan_literal(text: str, i: int, options: tuple[str, ...]) -> int | Scan:
    rest = text[i:]
    for literal in options:
        if rest.startswith(literal):
            return i + len(literal)
    if any(literal.startswith(rest) for literal in options):
        return Scan.MORE
    return Scan.NO


def _scan_string(text: str, i: int) -> int | Scan:
    """The end (after the closing quote) of the JSON string at `i`."""
    if text[i] != '"':
        return Scan.NO
    escaped = False
    for j in range(i + 1, len(text)):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return j + 1
    return Scan.MORE


@dataclass(slots=True)
class JsonValueEnd:
    """Follows an object or array across pieces of text to find where it ends."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str, start: int) -> tuple[int, bool]:
        """How far the value reaches in `text` from `start`, and whether it ends there."""
        i = start
        while i < len(text):
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i, True
        return i, False


@dataclass(slots=True)
class CallBuilder:
    """The calls of one output, built as their pieces arrive."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    value: JsonValueEnd = field(default_factory=JsonValueEnd)

    def open(self, name: str) -> ToolCallDelta:
        call_id = new_call_id()
        self.calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        self.value = JsonValueEnd()
        return ToolCallDelta(len(self.calls) - 1, "", call_id, name)

    def arguments(self, text: str, start: int) -> tuple[int, bool, ToolCallDelta | None]:
        """Stream the open call's arguments from `start`: the position reached, whether the
        arguments ended, and the fragment (None when no text was new)."""
        end, done = self.value.scan(text, start)
        if end == start:
            return end, done, None
        fragment = text[start:end]
        self.calls[-1]["function"]["arguments"] += fragment
        return end, done, ToolCallDelta(len(self.calls) - 1, fragment)


@dataclass(slots=True)
class ScanningParser(CallParser):
    """A parser over the whole output so far: `text` grows by each feed, `pos` is where its
    scan stands, `state` is the subclass's own, and `builder` holds the calls."""

    text: str = ""
    pos: int = 0
    state: str = "start"
    builder: CallBuilder = field(default_factory=CallBuilder)

    @property
    def calls(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.builder.calls

    def feed(self, new: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += new
        return self.scan(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.scan(final=True)

    def stream_arguments(self, deltas: list[ToolCallDelta]) -> bool:
        """Advance over the open call's arguments from `pos`, adding their new fragment to
        `deltas`; whether the arguments ended."""
        self.pos, done, delta = self.builder.arguments(self.text, self.pos)
        if delta is not None:
            deltas.append(delta)
        return done

    @abc.abstractmethod
    def scan(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Scan from `pos` on: the content and call deltas found (at the end: `final`)."""


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """Tools as chat templates take them (`tools=` of apply_chat_template)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            },
        }
        for t in tools
    ]


def history_calls(i: int, message: dict[str, Any]) -> list[tuple[str, Any]]:
    """An assistant turn's earlier calls as (name, arguments), the arguments decoded from
    their JSON text when they are that (templates write them out themselves)."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise FieldError(f"messages[{i}].tool_calls", "must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(f"{where}.function.name", "required (a string)")
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else kept as the client's text
                args = json.loads(args)
        out.append((fn["name"], args))
    return out
