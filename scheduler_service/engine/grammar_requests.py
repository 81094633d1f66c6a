"""The engine's side of structured output: each constrained request's compile, from its
start to the request's first sample.

A constrained group's grammar starts compiling when the group is added or imported
(`scheduler_service.engine.grammar`: one matcher per sequence, replaying its output). Until the
compile ends the group is tracked here. The replica waits for the compiles its next step
needs, but never past a group's deadline (`SchedulerConfig.max_grammar_compile_ms` from the
compile's submission, or from the end of the compiler's warm-up, when it was submitted
during it: the tokenizer's load is not the grammar's time, and after a restart it can take
seconds): a grammar still compiling then ends its request with RESOURCE_EXHAUSTED
(429) naming the field and the flag, so one slow grammar holds its replica's other requests
for a bounded time. The compile thread itself cannot be interrupted; llguidance's own fuel
limits bound it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future

from llmserve.errors import ApiError, FieldError, ResourceExhaustedError
from llmserve.grammar.backend import CompiledGrammar, GrammarError
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.reasoning import BUDGET_FIELD
from scheduler_service.engine import metrics
from scheduler_service.engine.grammar import GrammarCompiler, SequenceGrammar
from scheduler_service.engine.sequence import SequenceGroup


def grammar_failure(exc: BaseException, field: str) -> ApiError:
    """The client's error for a grammar that failed on the scheduler."""
    if isinstance(exc, GrammarError):
        return FieldError(exc.field, exc.detail)
    return FieldError(field, f"cannot be compiled for this model: {exc}")


class GrammarRequests:
    """Constrained groups whose grammar is still compiling (or failed to)."""

    def __init__(
        self,
        compiler: GrammarCompiler | None,
        max_compile_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`compiler` None: constrained requests are refused (no tokenizer here)."""
        self._compiler = compiler
        self._max_compile_ms = max_compile_ms
        self._clock = clock
        # request id -> (group, the clock's time its compile must end by; None while the
        # compiler warms up)
        self._compiling: dict[str, tuple[SequenceGroup, float | None]] = {}

    def warm(self) -> None:
        """Prepare compilation (the tokenizer and its backend) in the background."""
        if self._compiler is not None:
            self._compiler.warm()

    def start(self, group: SequenceGroup) -> None:
        """Give each unfinished sequence of a constrained group a matcher that replays its
        output so far (nothing for a new request) once the grammar is compiled."""
        spec, reasoning = group.grammar, group.reasoning
        if reasoning is not None and spec is None and reasoning.budget is None:
            reasoning = None  # nothing to enforce in the block or after it
        if spec is None and reasoning is None:
            return
        field = spec.field if spec is not None else BUDGET_FIELD
        if self._compiler is None:
            raise FieldError(field, "this scheduler has no tokenizer to compile grammars")
        stop_ids: set[int] = set(group.sampling_params.stop_token_ids)
        if (eos := group.seqs[0].eos_token_id) is not None:
            stop_ids.add(eos)
        compiled = self._compiler.submit(spec, reasoning, stop_ids)
        for seq in group.get_unfinished_seqs():
            seq.grammar = SequenceGrammar(
                compiled, seq.get_output_token_ids(), metrics.record_grammar_refused_token
            )
        self._compiling[group.request_id] = (group, self._deadline())

    def _deadline(self) -> float | None:
        """The deadline of a compile submitted now; None while the compiler warms up."""
        if self._compiler is not None and self._compiler.is_warming():
            return None
        return self._clock() + self._max_compile_ms / 1000

    def discard(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)

    def _pending(self) -> list[tuple[SequenceGroup, SequenceGrammar, float]]:
        """Tracked groups that still have a sequence, with its grammar and deadline (a
        compile submitted during the warm-up gets its deadline once the warm-up is over;
        until then it has none: infinity)."""
        out = []
        for request_id, (group, deadline) in list(self._compiling.items()):
            seqs = group.get_unfinished_seqs()
            grammar = seqs[0].grammar if seqs else None
            if grammar is None:
                del self._compiling[request_id]
                continue
            if deadline is None and (deadline := self._deadline()) is not None:
                self._compiling[request_id] = (group, deadline)
            out.append((group, grammar, math.inf if deadline is None else deadline))
        return out

    def due(self, token_budget: int) -> tuple[list[Future[CompiledGrammar]], float]:
        """Compiles the next step may wait for (those of groups whose prompt could finish
        prefilling in a step of `token_budget` tokens), and for how long at most: the seconds
        to the earliest of their deadlines."""
        futures, deadlines = [], []
        now = self._clock()
        for group, grammar, deadline in self._pending():
            if grammar.is_ready() or deadline <= now:
                continue  # past its deadline: the next step ends its request
            seq = group.get_unfinished_seqs()[0]
            if seq.get_len() - seq.num_computed_tokens <= token_budget:
                futures.append(grammar.compiled)
                deadlines.append(deadline)
        # At most the limit: a compile queued behind the warm-up has no deadline yet.
        limit = self._max_compile_ms / 1000
        return futures, (min(min(deadlines) - now, limit) if deadlines else 0.0)

    def take_failures(self) -> list[tuple[SequenceGroup, ApiError]]:
        """The groups whose grammar failed to compile or is past its deadline, no longer
        tracked, each with the client's error. Groups whose grammar compiled leave too."""
        failures: list[tuple[SequenceGroup, ApiError]] = []
        now: float | None = None
        for group, grammar, deadline in self._pending():
            field = group.grammar.field if group.grammar is not None else BUDGET_FIELD
            if grammar.is_ready():
                del self._compiling[group.request_id]
                if (exc := grammar.failure()) is not None:
                    failures.append((group, grammar_failure(exc, field)))
                continue
            if now is None:
                now = self._clock()
            if now >= deadline:
                del self._compiling[group.request_id]
                metrics.record_grammar_compile_timeout()
                failures.append((group, ResourceExhaustedError(
                    f"{field}: the grammar took longer than {self._max_compile_ms} ms to "
                    "compile on the scheduler (--max-grammar-compile-ms)",
                    field,
                )))  # fmt: skip
        return failures


_default_cache: GrammarCache | None = None


def default_grammar_cache() -> GrammarCache:
    """The process's compile cache (llguidance), shared by every replica: a grammar is
    compiled once per tokenizer for the whole fleet."""
    global _default_cache
    if _default_cache is None:
        from llmserve.grammar.llguidance_backend import LLGuidanceBackend

        _default_cache = GrammarCache(LLGuidanceBackend, on_compile=metrics.record_grammar_compile)
    return _default_cache
