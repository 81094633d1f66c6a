"""`think_tags`, the format of Qwen3 and DeepSeek-R1: the thinking sits between `<think>` and
`</think>`, either opened by the model at the start of its output or by the chat template at
the end of the prompt (DeepSeek-R1's templates end the generation prompt with `<think>`).
Whether the rendered prompt left the block open decides where the parser starts. A template
that renders an empty block (`enable_thinking: false` in Qwen3's) leaves it closed.

The parser works on text, so the tags may be added tokens or plain text tokenized into
pieces; whitespace around the reasoning and before the answer is dropped, the same way
whole and streamed.
"""

from __future__ import annotations

from enum import Enum

from gateway.reasoning.base import ReasoningDelta, ReasoningFormat, ReasoningParser, partial_suffix

THINK_TAGS = "think_tags"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class _State(Enum):
    START = "start"  # nothing but whitespace yet: `<think>` may still come
    REASONING = "reasoning"
    ANSWER = "answer"


class ThinkTagsParser(ReasoningParser):
    def __init__(self, opened: bool) -> None:
        self._state = _State.REASONING if opened else _State.START
        self._held = ""  # text not yet given out (a partial tag, or whitespace to judge)
        self._answer_started = False
        self._reasoning_started = False

    @property
    def in_reasoning(self) -> bool:
        return self._state is not _State.ANSWER

    @property
    def in_block(self) -> bool:
        return self._state is _State.REASONING

    @property
    def opening(self) -> bool:
        return self._state is _State.START and bool(self._held)

    def feed(self, new: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text, self._held = self._held + new, ""
        while text:
            if self._state is _State.START:
                text = self._start(text)
                if self._held:
                    break
            elif self._state is _State.REASONING:
                text = self._reasoning(text, out)
            else:
                out.answer += self._answer_text(text)
                text = ""
        return out

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return ReasoningDelta(reasoning=held if self._reasoning_started else held.lstrip())
        return ReasoningDelta(answer=self._answer_text(held) if held.strip() else "")

    def _start(self, text: str) -> str:
        stripped = text.lstrip()
        if not stripped:
            self._held = text
            return ""
        if stripped.startswith(THINK_OPEN):
            self._state = _State.REASONING
            return stripped[len(THINK_OPEN) :]
        if THINK_OPEN.startswith(stripped):
            self._held = text
            return ""
        self._state = _State.ANSWER
        return text

    def _reasoning(self, text: str, out: ReasoningDelta) -> str:
        """Reasoning text up to `</think>`; returns what follows the tag (the answer)."""
        end = text.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += self._reasoning_text(text[:end].rstrip())
            self._state = _State.ANSWER
            return text[end + len(THINK_CLOSE) :]
        # Hold back a partial `</think>` and trailing whitespace (dropped if the tag follows).
        keep = partial_suffix(text, THINK_CLOSE)
        body, tail = text[: len(text) - keep], text[len(text) - keep :]
        trimmed = body.rstrip()
        out.reasoning += self._reasoning_text(trimmed)
        self._held = body[len(trimmed) :] + tail
        return ""

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text

    def _answer_text(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text


class ThinkTagsFormat(ReasoningFormat):
    name = THINK_TAGS
    open_text = THINK_OPEN
    end_text = THINK_CLOSE
    close_text = "\n" + THINK_CLOSE

    def opened_in(self, prompt_text: str) -> bool:
        return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)

    def closed_in(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK_CLOSE)

    def parser(self, opened: bool) -> ReasoningParser:
        return ThinkTagsParser(opened)
