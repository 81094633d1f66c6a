"""One chat choice's output, read as it grows: the reasoning parser takes the thinking off,
then the tool format's parser reads calls from the answer alone. Every chat-shaped API (chat
completions, Responses, Messages) reads its choices through this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.reasoning import ReasoningParser, ReasoningRequest
from gateway.tool_formats import CallParser, ToolCallDelta, ToolFormat
from gateway.tools import ToolRequest


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutput:
    """Reasoning, content and tool calls of one choice. `reasoning_tokens` counts the
    output tokens of updates that opened the reasoning block (with those before that the
    parser held as its possible opening), arrived while it was open, or closed it: with one
    token per update, the tokens up to and with `</think>` (harmony: every analysis message,
    header to `<|end|>`), and none when the output never opens a block."""

    def __init__(
        self,
        reasoning: ReasoningRequest | None,
        tools: ToolRequest | None,
        tool_format: ToolFormat,
    ) -> None:
        self._reasoning: ReasoningParser | None = None if reasoning is None else reasoning.parser()
        self._calls: CallParser | None = None if tools is None else tool_format.parser()
        self.reasoning_tokens = 0
        # Tokens of updates held as a possible opening: reasoning if the block opens.
        self._opening_tokens = 0

    @property
    def parses_reasoning(self) -> bool:
        return self._reasoning is not None

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The calls so far, in OpenAI's `message.tool_calls` form."""
        return [] if self._calls is None else self._calls.calls

    def feed(self, text: str, num_tokens: int) -> ChatDelta:
        if self._reasoning is None:
            return self._answer(text)
        was_open = self._reasoning.in_block
        split = self._reasoning.feed(text)
        if was_open or self._reasoning.in_block:
            self.reasoning_tokens += self._opening_tokens + num_tokens
            self._opening_tokens = 0
        elif self._reasoning.opening:
            self._opening_tokens += num_tokens
        else:
            self._opening_tokens = 0
        out = self._answer(split.answer)
        out.reasoning = split.reasoning
        return out

    def feed_last(self, text: str, num_tokens: int, last: bool) -> ChatDelta:
        """`feed` one update of a stream; on the choice's `last` one, with what `finish`
        gives joined to it."""
        out = self.feed(text, num_tokens)
        if last:
            _join(out, self.finish())
        return out

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out = self._answer(split.answer)
            out.reasoning = split.reasoning
        if self._calls is not None:
            held, calls = self._calls.finish()
            out.content += held
            out.calls += calls
        return out

    def _answer(self, text: str) -> ChatDelta:
        if self._calls is None:
            return ChatDelta(content=text)
        content, calls = self._calls.feed(text) if text else ("", [])
        return ChatDelta(content=content, calls=calls)


def read_all(output: ChatOutput, pieces: list[tuple[str, int]]) -> ChatDelta:
    """A whole choice from its updates' (text, token count), fed as a stream would feed
    them, so that whole and streamed responses agree."""
    total = ChatDelta()
    for text, num_tokens in pieces:
        _join(total, output.feed(text, num_tokens))
    _join(total, output.finish())
    return total


def _join(total: ChatDelta, d: ChatDelta) -> None:
    total.reasoning += d.reasoning
    total.content += d.content
    total.calls += d.calls
