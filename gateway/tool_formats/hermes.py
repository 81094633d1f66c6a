"""The Hermes tool format (Hermes 2 Pro, Qwen 2.5, Qwen3): the chat template renders the
tools, and the model answers with one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly after some text. The grammar writes the blocks one newline apart; for `auto` it
allows text without `<tool_call>` in it, or text followed by blocks.
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
    lark_string,
    scan_header,
    scan_literal,
    text_without,
)
from gateway.tool_formats.native import TemplateToolsFormat
from gateway.tools import ToolRequest
from llmserve.grammar.spec import GrammarKind, GrammarSpec

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesFormat(TemplateToolsFormat):
    name = "hermes"

    def grammar(self, request: ToolRequest) -> GrammarSpec:
        more = '("\\n" block)*' if request.parallel else ""
        rules = [
            f"call: {lark_json(any_of(call_schemas(request, 'arguments')))}",
            f"block: {lark_string(OPEN + chr(10))} call {lark_string(chr(10) + CLOSE)}",
        ]
        if request.choice == "auto":
            # `opener` ends at the first `<tool_call>` (a lazy lexeme); TEXT never has one.
            rules[:0] = [
                f"start: TEXT | opener call {lark_string(chr(10) + CLOSE)} {more}",
                f"opener[lazy]: ANY {lark_string(OPEN + chr(10))}",
                "ANY: /(.|\\n)*/",
                f"TEXT: /{text_without(OPEN)}/",
            ]
        else:
            rules.insert(0, f"start: block {more}")
        return GrammarSpec(GrammarKind.LARK, "\n".join(rules), TOOLS_FIELD)

    def parser(self) -> HermesParser:
        return HermesParser()


def _partial_suffix(text: str, start: int, marker: str) -> int:
    """How many characters at the end of text[start:] begin `marker`."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - n :]):
            return n
    return 0


@dataclass(slots=True)
class HermesParser(ScanningParser):
    """Text, then `<tool_call>` blocks. A block that is not a call (no JSON object with a
    name and arguments after `<tool_call>`) stays text; whitespace around calls is dropped."""

    state: str = "text"
    # Whitespace not yet sent: it is content only if text follows it (or no call does).
    pending: str = ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.scan(final=True)
        if not self.calls:
            content += self.pending
        self.pending = ""
        return content, deltas

    def scan(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            state = self.state
            if state == "text":
                if not self._text(final, content):
                    break
            elif state == "header":
                header = scan_header(self.text, self.pos + len(OPEN), ("arguments",))
                if isinstance(header, Header):
                    self.pending = ""
                    deltas.append(self.builder.open(header.name))
                    self.pos, self.state = header.end, "arguments"
                elif header is Scan.MORE and not final:
                    break
                else:  # not a call: the marker is text
                    content.append(self.pending + OPEN)
                    self.pending = ""
                    self.pos, self.state = self.pos + len(OPEN), "text"
            elif state == "arguments":
                if not self.stream_arguments(deltas):
                    break
                self.state = "close"
            elif state == "close":
                end = scan_literal(self.text, self.pos, "}")
                if isinstance(end, int):
                    brace, end = end, scan_literal(self.text, end, CLOSE)
                    if end is Scan.NO:
                        self.pos = brace  # the call is whole; what follows is text
                if isinstance(end, int):
                    self.pos, self.state = end, "text"
                elif end is Scan.MORE:
                    if not final:
                        break
                    self.pos, self.state = len(self.text), "text"  # cut while closing
                else:
                    self.state = "broken"
            else:  # broken: a call that does not close; the rest is text
                content.append(self.text[self.pos :])
                self.pos = len(self.text)
                break
        return "".join(content), deltas

    def _text(self, final: bool, content: list[str]) -> bool:
        """Text up to the next `<tool_call>`, holding back what may begin one and trailing
        whitespace. True when a block starts."""
        i = self.text.find(OPEN, self.pos)
        end = i if i >= 0 else len(self.text)
        if i < 0 and not final:
            end -= _partial_suffix(self.text, self.pos, OPEN)
        piece = self.text[self.pos : end]
        body = piece.rstrip()
        if body:
            content.append(self.pending + body)
            self.pending = ""
        self.pending += piece[len(body) :]
        self.pos = end
        if i >= 0:
            self.state = "header"
            return True
        return False
