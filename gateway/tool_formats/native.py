"""What the template-native formats share: the chat template renders the tools (its `tools=`
argument), the earlier calls (assistant `tool_calls`) and their results (`role: "tool"`
turns) itself, the way the model was trained on them."""

from __future__ import annotations

from typing import Any

from gateway.tool_formats.base import ToolFormat, history_calls, template_tools
from gateway.tools import ToolRequest


class TemplateToolsFormat(ToolFormat):
    """A format whose chat template knows tools."""

    def render(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                # Templates write the arguments out themselves (`| tojson`): an object.
                parsed = history_calls(i, m)
                ids = [c.get("id") for c in m["tool_calls"]]
                calls = [
                    {"id": call_id, "type": "function", "function": {"name": n, "arguments": a}}
                    for call_id, (n, a) in zip(ids, parsed, strict=True)
                ]
                out.append({**m, "tool_calls": calls})
            else:
                out.append(m)
        return out, None if request is None else template_tools(request.tools)
