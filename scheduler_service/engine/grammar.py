"""Grammar state owned by the scheduler (structured output).

Each sequence of a constrained request holds a `SequenceGrammar`: a matcher advanced on every
token the scheduler appends to the sequence (sampled or forced), copied when the sequence
forks, and rebuilt by replaying the sequence's output when the request is imported (migration,
recompute elsewhere, a re-submitted continuation after a scheduler restart). So a killed
worker, a preemption or a restart never lose the grammar's position: it is a function of the
tokens, and the scheduler holds every token.

Compilation runs in a background thread (`GrammarCompiler`): prefill starts at once and the
grammar is waited for only when the sequence first samples. Tokens appended before it is
ready (a continuation's) are kept and replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from llmserve.grammar.backend import CompiledGrammar, GrammarError, GrammarMatcher
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.masks import encode_mask
from llmserve.grammar.reasoning import BUDGET_FIELD, ReasoningGrammar, ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.steps import MaskKind, TokenMask


class GrammarCompiler:
    """Compiles specs off the scheduler's loop, through one cache for the whole fleet."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        cache: GrammarCache,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_error()` observes failures outside the cache's compiles (tokenizer loads)."""
        self._load_tokenizer = load_tokenizer
        self.cache = cache
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._on_error = on_error
        self._warming: Future[None] | None = None

    def warm(self) -> None:
        """Load the tokenizer and build its backend in the background now, so the first
        constrained request does not wait for them (seconds) on the scheduler's loop."""
        self._warming = self._pool.submit(self._warm)

    def is_warming(self) -> bool:
        """Whether the warm-up is still running (compiles queue behind it)."""
        return self._warming is not None and not self._warming.done()

    def _warm(self) -> None:
        # A failure is reported by the first request that needs the tokenizer.
        with contextlib.suppress(Exception):
            self.cache.backend(self._load_tokenizer())

    def submit(
        self,
        spec: GrammarSpec | None,
        reasoning: ReasoningSpec | None = None,
        stop_ids: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> Future[CompiledGrammar]:
        """`spec` (None: free text), behind the reasoning block when `reasoning` is given
        (`llmserve.grammar.reasoning`; `stop_ids` may not end the output inside it)."""
        assert spec is not None or reasoning is not None
        return self._pool.submit(self._compile, spec, reasoning, stop_ids)

    def _compile(
        self, spec: GrammarSpec | None, reasoning: ReasoningSpec | None, stop_ids: set[int]
    ) -> CompiledGrammar:
        field = spec.field if spec is not None else BUDGET_FIELD
        try:
            tokenizer = self._load_tokenizer()
        except Exception as exc:  # the model's tokenizer files are not reachable here
            self._on_error()
            raise GrammarError(field, f"the model's tokenizer cannot be loaded: {exc}") from exc
        try:
            inner = self.cache.get(tokenizer, spec) if spec is not None else None
            if reasoning is None:
                assert inner is not None
                return inner
            vocab_size = self.cache.backend(tokenizer).vocab_size
            return ReasoningGrammar(reasoning, inner, vocab_size, stop_ids)
        except GrammarError:
            raise  # the cache counted it, or the reasoning's ids are not the model's
        except Exception as exc:  # the backend refused the tokenizer (not a fast one), ...
            self._on_error()
            raise GrammarError(field, f"cannot be compiled for this model: {exc}") from exc


class GrammarTimings:
    """Mask computation time: the worker waits for it (masks travel with their step)."""

    __slots__ = ("mask_seconds", "num_masks", "last_step_seconds")

    def __init__(self) -> None:
        # Totals, and the last step's time (0.0 when it had no constrained row).
        self.mask_seconds = 0.0
        self.num_masks = 0
        self.last_step_seconds = 0.0


class SequenceGrammar:
    """One sequence's matcher, or (until compilation ends) the tokens it will replay."""

    __slots__ = ("_compiled", "_matcher", "_pending", "forced_end", "_on_refused")

    def __init__(
        self,
        compiled: Future[CompiledGrammar],
        replay: list[int],
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_refused()` observes a token the grammar refuses (`accept`)."""
        self._compiled = compiled
        self._on_refused = on_refused
        self._matcher: GrammarMatcher | None = None
        self._pending = list(replay)
        # The sequence's length after the last tokens its grammar forced (None: none yet
        # here); asynchronous scheduling reads it (SchedulerConfig.forced_hold_tokens).
        self.forced_end: int | None = None

    @property
    def compiled(self) -> Future[CompiledGrammar]:
        return self._compiled

    def is_ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    def compile_seconds(self) -> float | None:
        """How long its grammar took to compile (None while compiling, or if it failed)."""
        if not self._compiled.done() or self._compiled.exception() is not None:
            return None
        return self._compiled.result().compile_seconds

    def failure(self) -> BaseException | None:
        """Why the grammar did not compile (None: it did). Call once `is_ready()`."""
        return None if self._matcher is not None else self._compiled.exception()

    def matcher(self) -> GrammarMatcher:
        """The matcher, after waiting for compilation and replaying what came before it.
        Raises `GrammarError` when the grammar does not compile or refuses the replay."""
        if self._matcher is None:
            matcher = self._compiled.result().matcher()
            for token_id in self._pending:
                if not matcher.accept(token_id):
                    raise GrammarError(
                        "grammar", f"the output so far does not match: {matcher.error()}"
                    )
            self._pending = []
            self._matcher = matcher
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance over an appended token. False: the grammar refuses it (reported to
        `on_refused`; the sequence is then aborted)."""
        if self._matcher is None and not self._compiled.done():
            self._pending.append(token_id)
            return True
        if self.matcher().accept(token_id):
            return True
        self._on_refused()
        return False

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def error(self) -> str:
        return "" if self._matcher is None else self._matcher.error()

    def mask(self, seq_id: int) -> TokenMask:
        return encode_mask(seq_id, self.matcher().bitmask(), self._compiled.result().vocab_size)

    def accepted_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` (drafts) the grammar accepts from where it stands,
        without the token that would complete it (the row after it would sample past the
        end); the matcher itself does not move. [] while compiling."""
        if self._matcher is None:
            return []
        matcher = self._matcher.copy()
        for i, token_id in enumerate(tokens):
            if not matcher.accept(token_id) or matcher.is_terminated():
                return tokens[:i]
        return tokens

    def row_masks(self, seq_id: int, drafts: list[int]) -> list[TokenMask]:
        """One mask per sampling row of a sequence with `drafts` (accepted by the grammar:
        `accepted_prefix`): the grammar as it stands, then after each draft in turn."""
        vocab_size = self._compiled.result().vocab_size
        matcher = self.matcher()
        masks = [encode_mask(seq_id, matcher.bitmask(), vocab_size)]
        ahead = matcher.copy()
        for row, token_id in enumerate(drafts, 1):
            ahead.accept(token_id)
            mask = encode_mask(seq_id, ahead.bitmask(), vocab_size)
            mask.row = row
            masks.append(mask)
        return masks

    def only(self, seq_id: int, token_id: int) -> TokenMask:
        """A mask that allows `token_id` alone (a continuation row whose sample is a forced
        token the scheduler already holds: scheduler_service/engine/pipelined_steps.py)."""
        return TokenMask(seq_id, MaskKind.ALLOW, self._compiled.result().vocab_size, [token_id])

    def forced_tokens(self) -> list[int]:
        return self.matcher().forced_tokens()

    def fork(self) -> SequenceGrammar:
        child = SequenceGrammar(self._compiled, self._pending, self._on_refused)
        child.forced_end = self.forced_end
        if self._matcher is not None:
            child._matcher = self._matcher.copy()
        return child
