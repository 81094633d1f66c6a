"""Reasoning formats: how a model's thinking is told apart from its answer
(`--reasoning-parser`: a name, or `auto` to read it off the chat template).

`think_tags` is the format of Qwen3 and DeepSeek-R1: the thinking sits between `<think>` and
`</think>`, either opened by the model at the start of its output or by the chat template at
the end of the prompt (DeepSeek-R1's templates end the generation prompt with `<think>`).
Whether the rendered prompt left the block open decides where the parser starts. A template
that renders an empty block (`enable_thinking: false` in Qwen3's) leaves it closed.

The parser works on text, so the tags may be added tokens or plain text tokenized into
pieces; whitespace around the reasoning and before the answer is dropped, the same way
whole and streamed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from llmserve.grammar.reasoning import ReasoningSpec

AUTO = "auto"
NONE = "none"
THINK_TAGS = "think_tags"
REASONING_PARSERS = (AUTO, NONE, THINK_TAGS)
_FLAG = "--reasoning-parser"

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    answer: str = ""


class ReasoningParser(abc.ABC):
    """Cuts one choice's output into reasoning and answer as it grows."""

    @abc.abstractmethod
    def feed(self, new: str) -> ReasoningDelta:
        """What `new` completes (text that may still be part of a tag is held back)."""

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta:
        """At the end of the output: what was held back."""

    @property
    @abc.abstractmethod
    def in_reasoning(self) -> bool:
        """Whether the output is (or may still be) inside the reasoning block."""

    @property
    @abc.abstractmethod
    def in_block(self) -> bool:
        """Whether the output is inside an opened reasoning block."""


class ReasoningFormat(abc.ABC):
    """One way models write their reasoning."""

    name: str
    # The texts that open and end the block, and what the scheduler appends to close it when
    # a thinking budget is spent (ends with `end_text`).
    open_text: str
    end_text: str
    close_text: str

    @abc.abstractmethod
    def opened_in(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the reasoning block open for the output."""

    @abc.abstractmethod
    def closed_in(self, prompt_text: str) -> bool:
        """Whether the rendered prompt ends with a closed block (thinking turned off): the
        output is all answer."""

    @abc.abstractmethod
    def parser(self, opened: bool) -> ReasoningParser:
        """A parser for one choice; `opened`: the prompt opened the block."""


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
        keep = _partial_suffix(text, THINK_CLOSE)
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


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


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


@dataclass(frozen=True, slots=True)
class ReasoningRequest:
    """A chat request's reasoning: its format, whether the prompt opened the block or closed
    it (thinking turned off), and the thinking budget the scheduler enforces (None: none)."""

    format: ReasoningFormat
    opened: bool
    closed: bool = False
    budget: int | None = None

    def parser(self) -> ReasoningParser:
        return self.format.parser(self.opened)

    def scheduler_spec(
        self, token_ids: Callable[[str], list[int]], constrained: bool
    ) -> ReasoningSpec | None:
        """What the scheduler must enforce (`llmserve.grammar.reasoning`), with the format's
        texts as `token_ids(text)` gives them; None when nothing is: thinking turned off, or
        neither a budget nor a grammar (`constrained`) to start after the block."""
        if self.closed or (self.budget is None and not constrained):
            return None
        fmt = self.format
        end_ids = tuple(token_ids(fmt.end_text))
        close_ids = tuple(token_ids(fmt.close_text[: -len(fmt.end_text)])) + end_ids
        return ReasoningSpec(
            tuple(token_ids(fmt.open_text)), end_ids, close_ids, self.opened, self.budget
        )


FORMATS: dict[str, ReasoningFormat] = {THINK_TAGS: ThinkTagsFormat()}


def detect_format(template: str | None) -> str:
    """`think_tags` for a chat template that writes both tags, else `none`."""
    if template and THINK_OPEN in template and THINK_CLOSE in template:
        return THINK_TAGS
    return NONE


def reasoning_format(name: str, template: str | None) -> ReasoningFormat | None:
    """The format `--reasoning-parser NAME` picks for this chat template (None: the output
    is all answer). ValueError naming the flag for an unknown name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"{_FLAG}: must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    if name == AUTO:
        name = detect_format(template)
    return FORMATS.get(name)
