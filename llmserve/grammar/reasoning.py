"""The reasoning block of a thinking model's output, as the scheduler enforces it.

A reasoning model writes its thinking first, between an opening and a closing tag (`<think>`
and `</think>`: `gateway/reasoning/` tells the gateway's parser the same), then its answer.
A `ReasoningSpec` names those tags as token ids. The scheduler follows each sequence through
the block with a `ReasoningMatcher`, a grammar matcher in front of the request's own grammar:

- before the block (the prompt did not open it): the model may open it, or answer at once;
- inside it: free text; once `budget` tokens were spent there, the matcher forces the closing
  text (`close_ids`), so the answer always gets its turn;
- after it: the request's grammar (structured output, tool calls) from its first token, or
  free text when the request has none.

It is a function of the output tokens like any matcher, so replays (a killed worker, a
scheduler restart, a migration) put it back where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from llmserve.errors import FieldError
from llmserve.grammar.backend import CompiledGrammar, GrammarError, GrammarMatcher

# The request field a budget comes from (OpenAI-compatible chat, vLLM's name).
BUDGET_FIELD = "thinking_token_budget"


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """`open_ids` open the block (unused when `opened`: the prompt opened it), `end_ids` end
    it wherever the model writes them, `close_ids` (ending with `end_ids`) are what the
    scheduler appends when `budget` thinking tokens were spent (None: no budget)."""

    open_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    opened: bool
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise FieldError("reasoning.end_ids", "must not be empty")
        if self.close_ids[-len(self.end_ids) :] != self.end_ids:
            raise FieldError("reasoning.close_ids", "must end with end_ids")
        if not self.opened and not self.open_ids:
            raise FieldError("reasoning.open_ids", "must not be empty unless opened")
        if self.budget is not None and self.budget < 0:
            raise FieldError(BUDGET_FIELD, f"must be at least 0, got {self.budget}")

    def token_ids(self) -> set[int]:
        return {*self.open_ids, *self.end_ids, *self.close_ids}


class _Where(Enum):
    BEFORE = 0  # the block may still open
    INSIDE = 1  # thinking
    CLOSING = 2  # the budget is spent: the closing text is being appended
    AFTER = 3  # the answer


def _bits(vocab_size: int, token_ids: set[int]) -> np.ndarray:  # [words] uint32
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    for token_id in token_ids:
        words[token_id >> 5] |= np.uint32(1 << (token_id & 31))
    return words


class ReasoningGrammar(CompiledGrammar):
    """A request's grammar (`inner`; None: free text) behind its reasoning block.

    `stop_ids` (EOS, stop tokens) are refused inside the block when there is an inner
    grammar: the output may not end before the answer the grammar requires."""

    def __init__(
        self,
        spec: ReasoningSpec,
        inner: CompiledGrammar | None,
        vocab_size: int,
        stop_ids: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        if any(not 0 <= t < vocab_size for t in spec.token_ids()):
            raise GrammarError("reasoning", f"has token ids outside the vocabulary ({vocab_size})")
        self.spec = spec
        self.inner = inner
        self.vocab_size = vocab_size
        self.compile_seconds = inner.compile_seconds if inner is not None else 0.0
        every = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        if vocab_size % 32:
            every[-1] = np.uint32((1 << (vocab_size % 32)) - 1)
        refused = stop_ids if inner is not None else set()
        # Inside the block: every token but `refused`.
        self.thinking_bytes = (
            every & ~_bits(vocab_size, {t for t in refused if t < vocab_size})
        ).tobytes()

    def matcher(self) -> ReasoningMatcher:
        inner = self.inner.matcher() if self.inner is not None else None
        return ReasoningMatcher(self, inner)


class ReasoningMatcher(GrammarMatcher):
    __slots__ = ("_grammar", "_inner", "_where", "_at", "_spent", "_error", "_answer")

    def __init__(self, grammar: ReasoningGrammar, inner: GrammarMatcher | None) -> None:
        self._grammar = grammar
        self._inner = inner
        # BEFORE: open_ids matched so far; INSIDE: end_ids matched so far; CLOSING: close_ids
        # appended so far.
        self._at = 0
        self._spent = 0  # tokens inside the block
        self._error = ""
        # BEFORE: whether the output so far may also be the answer's start (the inner
        # matcher has accepted it), as well as the start of the opening.
        self._answer = True
        self._where = _Where.BEFORE
        if grammar.spec.opened:
            self._enter()

    @property
    def in_reasoning(self) -> bool:
        return self._where is not _Where.AFTER

    def _enter(self) -> None:
        inner = self._grammar.inner
        if self._where is _Where.BEFORE and inner is not None and self._at:
            self._inner = inner.matcher()  # it followed the opening as a possible answer
        self._where, self._at, self._spent = _Where.INSIDE, 0, 0
        if self._grammar.spec.budget == 0:
            self._where = _Where.CLOSING

    def _refuse(self, why: str) -> bool:
        self._error = self._error or why
        return False

    def accept(self, token_id: int) -> bool:
        if self._error:
            return False
        spec = self._grammar.spec
        where = self._where
        if where is _Where.AFTER:
            return self._inner is None or self._inner.accept(token_id)
        if where is _Where.BEFORE:
            return self._before(token_id)
        if where is _Where.CLOSING:
            if token_id != spec.close_ids[self._at]:
                return self._refuse("the thinking budget is spent: the block must close")
            self._at += 1
            if self._at == len(spec.close_ids):
                self._where = _Where.AFTER
            return True
        end_ids = spec.end_ids
        if token_id == end_ids[self._at]:
            self._at += 1
            if self._at == len(end_ids):
                self._where = _Where.AFTER
                return True
        elif self._at:
            self._at = 1 if token_id == end_ids[0] else 0
        self._spent += 1
        if spec.budget is not None and self._spent >= spec.budget:
            self._where, self._at = _Where.CLOSING, 0
        return True

    def _before(self, token_id: int) -> bool:
        """The output may open the block, or be the answer from its first token; while what
        it wrote is a beginning of the opening, both stay possible (harmony's opening and its
        answer's channel header begin alike)."""
        spec = self._grammar.spec
        opens = token_id == spec.open_ids[self._at]
        if self._answer and self._inner is not None:
            probe = self._inner.copy() if opens else self._inner
            self._answer = probe.accept(token_id)
            if self._answer:
                self._inner = probe
        if opens:
            self._at += 1
            if self._at == len(spec.open_ids):
                self._enter()
            return True
        if not self._answer:
            return self._refuse("neither the reasoning block's opening nor the answer")
        self._where = _Where.AFTER  # no reasoning: the output is all answer
        return True

    def bitmask(self) -> bytes:
        where = self._where
        grammar = self._grammar
        if where is _Where.AFTER:
            return self._inner.bitmask() if self._inner is not None else grammar.thinking_bytes
        if where is _Where.INSIDE:
            return grammar.thinking_bytes
        spec = grammar.spec
        if where is _Where.CLOSING:
            return _bits(grammar.vocab_size, {spec.close_ids[self._at]}).tobytes()
        opening = _bits(grammar.vocab_size, {spec.open_ids[self._at]})
        if not self._answer:
            return opening.tobytes()
        if self._inner is None:
            return grammar.thinking_bytes
        words = np.frombuffer(self._inner.bitmask(), dtype=np.uint32, count=len(opening))
        return (words | opening).tobytes()

    def forced_tokens(self) -> list[int]:
        if self._where is _Where.CLOSING:
            return list(self._grammar.spec.close_ids[self._at :])
        if self._where is _Where.AFTER and self._inner is not None:
            return self._inner.forced_tokens()
        return []

    def is_terminated(self) -> bool:
        return (
            self._where is _Where.AFTER and self._inner is not None and self._inner.is_terminated()
        )

    def error(self) -> str:
        if self._error:
            return self._error
        return self._inner.error() if self._inner is not None else ""

    def copy(self) -> ReasoningMatcher:
        twin = ReasoningMatcher.__new__(ReasoningMatcher)
        twin._grammar = self._grammar
        twin._inner = self._inner.copy() if self._inner is not None else None
        twin._where, twin._at, twin._spent, twin._error, twin._answer = (
            self._where,
            self._at,
            self._spent,
            self._error,
            self._answer,
        )
        return twin
