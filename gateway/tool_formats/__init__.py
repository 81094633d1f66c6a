"""Tool-call formats, one per way chat templates ask for calls, and the choice among them
(`--tool-call-parser`: a name, or `auto` to read it off the chat template)."""

from __future__ import annotations

import re

from gateway.tool_formats.base import CallParser, ToolCallDelta, ToolFormat
from gateway.tool_formats.generic import GenericFormat
from gateway.tool_formats.hermes import OPEN as HERMES_OPEN
from gateway.tool_formats.hermes import HermesFormat
from gateway.tool_formats.llama3_json import PYTHON_TAG, Llama3JsonFormat
from llmserve.tool_parsers import AUTO, TOOL_CALL_PARSERS, TOOL_FORMATS

__all__ = [
    "FORMATS",
    "CallParser",
    "ToolCallDelta",
    "ToolFormat",
    "detect_format",
    "tool_format",
]


def _by_name(*formats: ToolFormat) -> dict[str, ToolFormat]:
    """The formats by name: exactly one for each name `--tool-call-parser` offers
    (llmserve.tool_parsers owns the names; a name without a format, or a format without a
    name, is a mistake here, found when the gateway loads)."""
    by_name = {f.name: f for f in formats}
    if sorted(by_name) != sorted(TOOL_FORMATS) or len(by_name) != len(formats):
        raise RuntimeError(
            f"tool formats {sorted(f.name for f in formats)} do not match "
            f"llmserve.tool_parsers.TOOL_FORMATS {sorted(TOOL_FORMATS)}"
        )
    return by_name


FORMATS: dict[str, ToolFormat] = _by_name(GenericFormat(), HermesFormat(), Llama3JsonFormat())
_FLAG = "--tool-call-parser"

# A template that uses a `tools` variable (`{% if tools %}`, `tools | length`, ...).
_USES_TOOLS = re.compile(r"\btools\b")


def detect_format(template: str | None) -> str:
    """The format a chat template's source asks for: `hermes` when it renders tools and
    writes `<tool_call>`, `llama3_json` when it renders tools the Llama 3 way (the python
    tag, or calls with "parameters"), `generic` for a template without tools."""
    if not template or not _USES_TOOLS.search(template):
        return "generic"
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "generic"


def tool_format(name: str, template: str | None) -> ToolFormat:
    """The format `--tool-call-parser NAME` picks for this chat template. ValueError naming
    the flag for an unknown name, or for a template-native format whose template never
    renders tools (the model would not see them)."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"{_FLAG}: must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    if name == AUTO:
        return FORMATS[detect_format(template)]
    if name != "generic" and not (template and _USES_TOOLS.search(template)):
        raise ValueError(
            f"{_FLAG}: {name} needs a chat template that renders tools (this one never uses "
            "`tools`); use generic, or give such a template with --chat-template"
        )
    return FORMATS[name]
