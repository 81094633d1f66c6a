"""The default grammar backend: llguidance (fast compilation, refuses schema features it
cannot enforce, numpy-friendly bitmasks)."""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
from llguidance import LLMatcher, LLTokenizer

from llmserve.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from llmserve.grammar.spec import GrammarKind, GrammarSpec

# JSON as most models write it (and as json.dumps does): ", " and ": ", no other whitespace.
# A fixed layout also makes a constrained stream's bytes depend on the tokens alone. Applied
# over the schema's own "x-guidance" options, so a client cannot turn on "lenient" (features
# silently ignored) or change the layout the tool-call parser relies on.
JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (not yet checked)."""
    kind = spec.kind
    try:
        if kind == GrammarKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(
                json.loads(spec.source), overrides=JSON_OPTIONS
            )
        if kind == GrammarKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == GrammarKind.REGEX:
            return LLMatcher.grammar_from_regex(spec.source)
        if kind == GrammarKind.CHOICE:
            return llguidance.grammar_from("choice", spec.source)
        if kind == GrammarKind.LARK:
            return LLMatcher.grammar_from_lark(spec.source)
        if kind == GrammarKind.GBNF:
            return llguidance.grammar_from("gbnf", spec.source)
    except (ValueError, TypeError, RuntimeError) as exc:  # a GBNF that does not parse, ...
        raise GrammarError(spec.field, f"cannot be compiled: {exc}") from exc
    raise GrammarError(spec.field, f"unknown grammar kind {kind!r}")


def lark_text(spec: GrammarSpec) -> str:
    """`spec` as one Lark grammar of llguidance's dialect (a JSON schema as `%json`, with the
    layout options above), for a grammar that nests it (`%lark { ... }`)."""
    text = grammar_text(spec)
    if spec.kind in (GrammarKind.CHOICE, GrammarKind.LARK, GrammarKind.GBNF):
        return text  # Lark already
    # The others are llguidance's top-level grammars (JSON): one grammar, Lark or a schema.
    (grammar,) = json.loads(text)["grammars"]
    if grammar.get("lark_grammar"):
        return str(grammar["lark_grammar"])
    return "start: %json " + json.dumps(grammar["json_schema"])


def check_grammar(spec: GrammarSpec) -> None:
    """Admission check without a tokenizer (the gateway's): raises `GrammarError` for a
    malformed grammar or an unenforceable schema feature. Costs a grammar compile, not the
    token-level one, so it stays cheap."""
    text = grammar_text(spec)
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
    except Exception as exc:  # any input the validator chokes on is the client's to fix
        raise GrammarError(spec.field, f"cannot be compiled: {exc}") from exc
    if is_error:
        raise GrammarError(spec.field, _explain(messages))


def _explain(messages: list[str]) -> str:
    detail = "; ".join(m.strip() for m in messages) or "invalid grammar"
    if "Unimplemented keys" in detail or "Unknown format" in detail:
        return f"uses a JSON schema feature that cannot be enforced: {detail}"
    return f"cannot be compiled: {detail}"


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def bitmask(self) -> bytes:
        return self._m.compute_bitmask()

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, tokenizer: LLTokenizer, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self.vocab_size = tokenizer.vocab_size
        # The first matcher compiles the grammar; copies of it share that work.
        self._root = LLMatcher(tokenizer, grammar, log_level=0)

    @property
    def error(self) -> str:
        return self._root.get_error() if self._root.is_error() else ""

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._root.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    """Compiles for one Hugging Face (fast) tokenizer. Thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int | None = None) -> None:
        # llguidance's glue for Hugging Face tokenizers imports transformers: here, where a
        # tokenizer (and so transformers) is loaded already, not when a process that may
        # never compile a grammar (the scheduler) imports this backend.
        import llguidance.hf

        # About a second for a 50k vocabulary: build one backend per tokenizer.
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = self._tokenizer.vocab_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        grammar = LLGuidanceGrammar(self._tokenizer, grammar_text(spec))
        if grammar.error:
            raise GrammarError(spec.field, _explain([grammar.error]))
        return grammar
