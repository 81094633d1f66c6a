"""The names `--tool-call-parser` takes: `auto` or one tool-call format.

The names are part of the command line every launcher shares, so they are kept here: `llmserve
up` refuses an unknown one before it starts any process, and the gateway implements one
format per name (gateway.tool_formats, which refuses to load unless it has exactly these).
"""

from __future__ import annotations

# Read the format off the chat template.
AUTO = "auto"
# generic: tools in the system prompt, a JSON envelope; hermes: <tool_call> blocks (Hermes,
# Qwen); llama3_json: Llama 3.x JSON calls.
TOOL_FORMATS = ("generic", "hermes", "llama3_json")
# The values of --tool-call-parser.
TOOL_CALL_PARSERS = (AUTO, *TOOL_FORMATS)
