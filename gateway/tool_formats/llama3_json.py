"""The Llama 3 JSON tool format (Llama 3.1, 3.2, 3.3): the chat template renders the tools,
and the model answers with the calls alone,

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "parameters": ...}

possibly after `<|python_tag|>` (a special token, so usually gone from the decoded text).
The grammar writes calls "; " apart; for `auto` it also allows a text answer, which must
not start with `{`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_formats.base import (
    TOOLS_FIELD,
    Header,
    Scan,
    ScanningParser,
    ToolCallDelta,
    any_of,
    call_schemas,
    lark_json,
    scan_header,
    scan_literal,
)
from gateway.tool_formats.native import TemplateToolsFormat
from gateway.tools import ToolRequest
from llmserve.grammar.spec import GrammarKind, GrammarSpec

PYTHON_TAG = "<|python_tag|>"
# The key the template tells the model to put the arguments under; "arguments" is read too.
ARGUMENTS_KEYS = ("parameters", "arguments")


class Llama3JsonFormat(TemplateToolsFormat):
    name = "llama3_json"

    def grammar(self, request: ToolRequest) -> GrammarSpec:
        calls = 'call ("; " call)*' if request.parallel else "call"
        rules = [f"call: {lark_json(any_of(call_schemas(request, ARGUMENTS_KEYS[0])))}"]
        if request.choice == "auto":
            rules[:0] = [f"start: TEXT | {calls}", "TEXT: /[^{\\s](.|\\n)*/"]
        else:
            rules.insert(0, f"start: {calls}")
        return GrammarSpec(GrammarKind.LARK, "\n".join(rules), TOOLS_FIELD)

    def parser(self) -> Llama3JsonParser:
        return Llama3JsonParser()


@dataclass(slots=True)
class Llama3JsonParser(ScanningParser):
    """Calls from the start of the output, `;` apart. An output that does not start with a
    call is text, whole; what follows the calls, when it is not another one, is text too."""

    def scan(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            state = self.state
            if state in ("start", "next"):
                header = self._header()
                if isinstance(header, Header):
                    deltas.append(self.builder.open(header.name))
                    self.pos, self.state = header.end, "arguments"
                    continue
                if header is Scan.MORE and not final:
                    break
                if state == "start":
                    self.pos = 0  # not calls: the whole output is the answer
                self.state = "broken"
            elif state == "arguments":
                if not self.stream_arguments(deltas):
                    break
                self.state = "close"
            elif state == "close":
                end = scan_literal(self.text, self.pos, "}")
                if isinstance(end, int):
                    self.pos, self.state = end, "after"
                elif end is Scan.MORE and not final:
                    break
                elif end is Scan.MORE:
                    self.pos, self.state = len(self.text), "after"  # cut while closing
                else:
                    self.state = "broken"
            elif state == "after":
                end = scan_literal(self.text, self.pos, ";")
                rest = self.text[self.pos :]
                if isinstance(end, int):
                    self.pos, self.state = end, "next"
                elif not rest.strip():
                    if not final:
                        break
                    self.pos = len(self.text)  # trailing whitespace: dropped
                    break
                else:
                    self.state = "broken"
            else:  # broken: the rest is text
                content.append(self.text[self.pos :])
                self.pos = len(self.text)
                break
        return "".join(content), deltas

    def _header(self) -> Header | Scan:
        """The next call's header, after the python tag at the start."""
        i = self.pos
        if self.state == "start":
            tag = scan_literal(self.text, i, PYTHON_TAG)
            if tag is Scan.MORE and self.text[i:].strip():
                return Scan.MORE
            if isinstance(tag, int):
                i = tag
        return scan_header(self.text, i, ARGUMENTS_KEYS)
