"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (errors name the
field). How the tools reach the model and how its calls are read back is the tool format's
business (gateway/tool_formats/)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmserve.errors import FieldError
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
