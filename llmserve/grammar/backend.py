"""The contract between the scheduler and a grammar engine: a backend compiles a spec for
one tokenizer; a matcher follows one sequence's tokens and says what may come next."""

from __future__ import annotations

from abc import ABC, abstractmethod

from llmserve.grammar.spec import GrammarSpec


class GrammarError(Exception):
    """A grammar that cannot be compiled or enforced. `field` names the request field."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class GrammarMatcher(ABC):
    """One sequence's position in a grammar. Never raises on a bad token: it enters an
    error state (`error()`) that it never leaves."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over one token; False (and the error state) if the grammar refuses it."""

    @abstractmethod
    def bitmask(self) -> bytes:
        """Allowed next tokens: bit i (byte i // 8, bit i % 8) set iff token i is allowed."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (may be empty)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts no more text (EOS at most)."""

    @abstractmethod
    def error(self) -> str:
        """Why the matcher is in its error state; empty when it is not."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (for forks)."""


class CompiledGrammar(ABC):
    """A grammar compiled for a tokenizer: a factory of matchers at its start."""

    # Tokens of the tokenizer it was compiled for (a mask's length).
    vocab_size: int
    # Seconds its compilation took (set by the cache).
    compile_seconds: float = 0.0

    @abstractmethod
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer (`vocab_size` tokens)."""

    vocab_size: int

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises `GrammarError` naming `spec.field` for a malformed grammar or a feature the
        backend cannot enforce (never silently relaxed)."""
