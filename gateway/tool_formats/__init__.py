"""Tool-call formats, one per way chat templates ask for calls, and the choice among them
(`--tool-call-parser`: a name, or `auto` to read it off the chat template)."""

from __future__ import annotations

import re

from gateway.tool_formats.base import CallParser, ToolCallDelta, ToolFormat
from gateway.tool_formats.generic import GenericFormat
from gateway.tool_formats.hermes import OPEN as HERMES_OPEN
from gateway.tool_formats.hermes import HermesFormat
from gateway.tool_formats.llama3_json import PYTHON_TAG, Llama3JsonFormat

__all__ = [
    "FORMATS",
    "TOOL_PARSERS",
    "CallParser",
    "ToolCallDelta",
    "ToolFormat",
    "detect_format",
    "tool_format",
]

FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (GenericFormat(), HermesFormat(), Llama3JsonFormat())
}
# The values of --tool-call-parser.
TOOL_PARSERS = ("auto", *FORMATS)
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
    if name not in TOOL_PARSERS:
        raise ValueError(f"{_FLAG}: must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    if name == "auto":
        return FORMATS[detect_format(template)]
    if name != "generic" and not (template and _USES_TOOLS.search(template)):
        raise ValueError(
            f"{_FLAG}: {name} needs a chat template that renders tools (this one never uses "
            "`tools`); use generic, or give such a template with --chat-template"
        )
    return FORMATS[name]
