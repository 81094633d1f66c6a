"""The generic tool format, for chat templates that know no tools (SmolLM2's).

The tools' schemas go into the system prompt, and the grammar forces a JSON envelope:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}

for `tool_choice` "required" and a named function (that function only), and for "auto"
either that or `{"content": "..."}` (a call or a response). The grammar fixes the layout
(", " and ": ", nothing else), so `ToolCallStream` can cut the text into OpenAI's streamed
`delta.tool_calls` (id, type and name once per call, then argument fragments) as it grows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.tool_formats.base import (
    TOOLS_FIELD,
    ScanningParser,
    ToolCallDelta,
    ToolFormat,
    any_of,
    call_schemas,
    history_calls,
    object_schema,
)
from gateway.tools import ToolRequest
from llmserve.grammar.spec import GrammarSpec


class GenericFormat(ToolFormat):
    name = "generic"

    def render(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The tools in the system prompt, an assistant's tool calls as the envelope it would
        have written, a tool's result as a user turn naming the call."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": name, "arguments": args} for name, args in history_calls(i, m)]
                text = json.dumps({"tool_calls": calls}, separators=(", ", ": "))
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                call_id = m.get("tool_call_id") or ""
                out.append(
                    {"role": "user", "content": f"Result of tool call {call_id}: {m['content']}"}
                )
            else:
                out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        if request is not None:
            text = system_text(request)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out, None

    def grammar(self, request: ToolRequest) -> GrammarSpec:
        array: dict[str, Any] = {
            "type": "array",
            "items": any_of(call_schemas(request, "arguments")),
            "minItems": 1,
        }
        if not request.parallel:
            array["maxItems"] = 1
        envelope = object_schema({"tool_calls": array})
        if request.choice == "auto":
            answer = object_schema({"content": {"type": "string"}})
            return GrammarSpec.json_schema({"anyOf": [envelope, answer]}, TOOLS_FIELD)
        return GrammarSpec.json_schema(envelope, TOOLS_FIELD)

    def parser(self) -> ToolCallStream:
        return ToolCallStream()


def system_text(request: ToolRequest) -> str:
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
        for t in request.tools
    )
    text = (
        "You can call these tools:\n"
        f"{listed}\n"
        'To call tools, answer with only a JSON object: {"tool_calls": [{"name": '
        '<tool name>, "arguments": <the arguments object>}]}.'
    )
    if request.choice == "auto":
        text += ' To answer without a tool, reply with {"content": <your answer>}.'
    return text


_CALLS_OPEN = '{"tool_calls": ['
_CONTENT_OPEN = '{"content": "'


@dataclass(slots=True)
class ToolCallStream(ScanningParser):
    """Cuts one choice's envelope text into content and tool-call deltas as it grows."""

    def scan(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Content text and call deltas the text completes (the envelope holds nothing
        back at the end that could still be content: `final` changes nothing)."""
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
        for literal, state in ((_CALLS_OPEN, "call"), (_CONTENT_OPEN, "content")):
            if rest.startswith(literal):
                self.pos += len(literal)
                self.state = state
                return ""
        if not any(lit.startswith(rest) for lit in (_CALLS_OPEN, _CONTENT_OPEN)):
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
        self.state = "arguments"
        return self.builder.open(name)

    def _arguments(self) -> ToolCallDelta | None:
        self.pos, done, delta = self.builder.arguments(self.text, self.pos)
        if done:
            self.state = "after_call"
        return delta

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
