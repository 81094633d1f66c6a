"""Tool calling in the generic format, for chat templates that know no tools (SmolLM2's).

The tools' schemas go into the system prompt, and the grammar forces a JSON envelope:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}

for `tool_choice` "required" and a named function (that function only), and for "auto"
either that or `{"content": "..."}` (a call or a response). The grammar fixes the layout
(", " and ": ", nothing else), so `ToolCallStream` can cut the text into OpenAI's streamed
`delta.tool_calls` (id, type and name once per call, then argument fragments) as it grows.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import FieldError
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import RequestLimits

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and how they may be used (`choice`: auto, required, or the
    name of the one function to call)."""

    tools: tuple[Tool, ...]
    choice: str
    named: bool
    parallel: bool

    def grammar(self) -> GrammarSpec:
        calls = [_call_schema(t) for t in self.tools if not self.named or t.name == self.choice]
        items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        envelope = _object({"tool_calls": array})
        if self.choice == "auto":
            return GrammarSpec.json_schema(
                {"anyOf": [envelope, _object({"content": {"type": "string"}})]}, "tools"
            )
        return GrammarSpec.json_schema(envelope, "tools")

    def system_text(self) -> str:
        listed = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
            for t in self.tools
        )
        text = (
            "You can call these tools:\n"
            f"{listed}\n"
            'To call tools, answer with only a JSON object: {"tool_calls": [{"name": '
            '<tool name>, "arguments": <the arguments object>}]}.'
        )
        if self.choice == "auto":
            text += ' To answer without a tool, reply with {"content": <your answer>}.'
        return text


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_schema(tool: Tool) -> dict[str, Any]:
    return _object({"name": {"const": tool.name}, "arguments": tool.parameters})


def parse_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    limits: RequestLimits,
) -> ToolRequest | None:
    """The request's tools, checked (FieldError naming the field); None when the output is
    free text (no tools, or tool_choice "none")."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "needs tools")
        return None
    if len(tools) > limits.max_tools:
        raise FieldError(
            "tools",
            f"{len(tools)} tools is over this server's limit of {limits.max_tools} (--max-tools)",
        )
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names must be unique")
    choice, named = _choice(tool_choice, names)
    if choice == "none":
        return None
    return ToolRequest(parsed, choice, named, parallel_tool_calls is not False)


def _tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"{where}.type", "must be function")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise FieldError(f"{where}.function", "required")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(f"{where}.function.name", "must be 1-64 of a-z, A-Z, 0-9, _ and -")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise FieldError(f"{where}.function.parameters", "must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise FieldError(f"{where}.function.description", "must be a string")
    return Tool(name, description, params)


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, bool]:
    if tool_choice is None:
        return "auto", False
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, False
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise FieldError("tool_choice.function.name", f"no tool is named {name!r}")
        return name, True
    raise FieldError("tool_choice", "must be none, auto, required or a named function")


# -- prompts ----------------------------------------------------------------------------------


def render_messages(
    messages: list[dict[str, Any]], request: ToolRequest | None
) -> list[dict[str, Any]]:
    """Messages as a template without tools can render them: the tools in the system
    prompt, an assistant's tool calls as the envelope it would have written, a tool's result
    as a user turn naming the call."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            envelope = {
                "tool_calls": [
                    {"name": c["function"]["name"], "arguments": _arguments(c["function"])}
                    for c in calls
                ]
            }
            out.append(
                {"role": "assistant", "content": json.dumps(envelope, separators=(", ", ": "))}
            )
        elif m["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"Result of tool call {m.get('tool_call_id') or ''}: {m['content']}",
                }
            )
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if request is not None:
        text = request.system_text()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(fn: dict[str, Any]) -> Any:
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


# -- answers ----------------------------------------------------------------------------------


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


@dataclass(slots=True)
class ToolCallStream:
    """Cuts one choice's envelope text into content and tool-call deltas as it grows."""

    text: str = ""
    pos: int = 0
    state: str = "start"
    num_calls: int = 0
    # JSON string / nesting state inside the arguments being streamed.
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, new: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text and call deltas the new text completes."""
        self.text += new
        content = ""
        deltas: list[ToolCallDelta] = []
        while True:
            step = getattr(self, f"_{self.state}")()
            if step is None:
                return content, deltas
            if isinstance(step, str):
                content += step
            else:
                deltas.append(step)

    def _expect(self, literal: str) -> bool | None:
        rest = self.text[self.pos :]
        if rest.startswith(literal):
            self.pos += len(literal)
            return True
        if literal.startswith(rest):
            return None  # not enough text yet
        self.state = "broken"
        return False

    def _start(self) -> str | None:
        rest = self.text[self.pos :]
        for literal, state in (('{"tool_calls": [', "call"), ('{"content": "', "content")):
            if rest.startswith(literal):
                self.pos += len(literal)
                self.state = state
                return ""
        if not any(lit.startswith(rest) for lit in ('{"tool_calls": [', '{"content": "')):
            self.state = "broken"
            return ""
        return None

    def _call(self) -> ToolCallDelta | str | None:
        start = self.pos
        if self._expect('{"name": "') is not True:
            self.pos = start
            return "" if self.state == "broken" else None
        end = self.text.find('"', self.pos)
        if end < 0 or not self.text.startswith('", "arguments": ', end):
            self.pos = start
            if end >= 0 and len(self.text) >= end + len('", "arguments": '):
                self.state = "broken"
                return ""
            return None
        name = self.text[self.pos : end]
        self.pos = end + len('", "arguments": ')
        call_id = new_call_id()
        self.calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        self.state = "arguments"
        self.depth, self.in_string, self.escaped = 0, False, False
        return ToolCallDelta(len(self.calls) - 1, "", call_id, name)

    def _arguments(self) -> ToolCallDelta | None:
        start = self.pos
        text = self.text
        i = start
        done = False
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
                    done = True
                    break
        self.pos = i
        if done:
            self.state = "after_call"
        if i == start:
            return None
        fragment = text[start:i]
        self.calls[-1]["function"]["arguments"] += fragment
        return ToolCallDelta(len(self.calls) - 1, fragment)

    def _after_call(self) -> str | None:
        rest = self.text[self.pos :]
        if rest.startswith("}, "):
            self.pos += 3
            self.state = "call"
            return ""
        if rest.startswith("}]}"):
            self.pos += 3
            self.state = "done"
            return ""
        if "}, ".startswith(rest) or "}]}".startswith(rest):
            return None
        self.state = "broken"
        return ""

    def _content(self) -> str | None:
        """Decoded string content, up to the last complete character or escape."""
        rest = self.text[self.pos :]
        i, out_end, escaped = 0, 0, False
        while i < len(rest):
            ch = rest[i]
            if escaped:
                if ch == "u":
                    if len(rest) < i + 5:
                        break
                    i += 4
                escaped = False
                out_end = i + 1
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                decoded = json.loads('"' + rest[:i] + '"')
                self.pos += i + 1
                self.state = "done"
                return decoded
            else:
                out_end = i + 1
            i += 1
        if out_end == 0:
            return None
        try:
            decoded = json.loads('"' + rest[:out_end] + '"')
        except json.JSONDecodeError:  # a surrogate pair cut in half: wait for the rest
            return None
        self.pos += out_end
        return decoded

    def _done(self) -> None:
        return None

    def _broken(self) -> str | None:
        """Not the envelope (the grammar was not applied): the rest is plain content."""
        rest = self.text[self.pos :]
        self.pos = len(self.text)
        return rest or None
