"""Structured output: grammars (JSON schema, regex, choice, Lark / GBNF) compiled against a
tokenizer into matchers that say which tokens may come next.

The scheduler owns the matchers (one per sequence); the gateway only checks grammars at
admission; workers never see a grammar, only each step's allowed tokens (`llmserve.steps`).
"""

from llmserve.grammar.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from llmserve.grammar.spec import GrammarKind, GrammarSpec

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarKind",
    "GrammarMatcher",
    "GrammarSpec",
]
