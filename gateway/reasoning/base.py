"""What every reasoning format gives: a parser that cuts a choice's output into reasoning and
answer as it grows, the texts that open and end the block (which the scheduler enforces as
token ids), and how a chat request's reasoning is described to both."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec


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

    @property
    @abc.abstractmethod
    def opening(self) -> bool:
        """Whether the text held back may still turn out to open the block (a tag, or a
        header, not yet complete): the tokens that wrote it are reasoning if it does."""


class ReasoningFormat(abc.ABC):
    """One way models write their reasoning."""

    name: str
    # The texts that open and end the block, and what the scheduler appends to close it when
    # a thinking budget is spent (ends with `end_text`).
    open_text: str
    end_text: str
    close_text: str
    # Tags the parser reads that tokenizers may hold as special tokens: decoded for it even
    # when a request skips special tokens (the parser leaves them out of what the client gets).
    special_tags: tuple[str, ...] = ()
    # Why chats with tools cannot be served in this format (None: they can).
    tools_refused: str | None = None

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

    def answer_grammar(self, grammar: GrammarSpec, closed: bool) -> GrammarSpec:
        """The grammar of what follows the block (or, `closed`: of the whole output) for a
        request whose answer must match `grammar`: the answer itself, unless the format
        frames it (harmony's final-message header)."""
        return grammar


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


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

    def answer_grammar(self, grammar: GrammarSpec) -> GrammarSpec:
        """The grammar the scheduler enforces for a request whose answer must match
        `grammar` (`ReasoningFormat.answer_grammar`)."""
        return self.format.answer_grammar(grammar, self.closed)

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
