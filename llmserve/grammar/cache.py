"""One compile cache per scheduler: a grammar is compiled once per tokenizer, however many
requests, replicas or sequences use it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from llmserve.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from llmserve.grammar.spec import GrammarSpec


class GrammarCache:
    """LRU of compiled grammars keyed by (tokenizer key, spec kind, spec source). Failures
    are cached too, so a bad grammar sent again costs nothing."""

    def __init__(
        self,
        backend_factory: Callable[[Any], GrammarBackend],
        max_entries: int = 256,
        on_compile: Callable[[float, bool], None] = lambda seconds, ok: None,
    ) -> None:
        """`backend_factory(tokenizer)` builds the backend of a tokenizer (once each);
        `on_compile(seconds, ok)` observes every compile (metrics)."""
        self._factory = backend_factory
        # id(tokenizer) -> (the tokenizer, kept alive so its id is not reused; its backend)
        self._backends: dict[int, tuple[Any, GrammarBackend]] = {}
        self._entries: OrderedDict[tuple[int, int, str], CompiledGrammar | GrammarError] = (
            OrderedDict()
        )
        self._max = max_entries
        self._lock = threading.Lock()
        self._building = threading.Lock()  # held while a backend is built
        self._on_compile = on_compile
        self.hits = 0
        self.misses = 0

    def backend(self, tokenizer: Any) -> GrammarBackend:
        key = id(tokenizer)
        with self._lock:
            entry = self._backends.get(key)
        if entry is None:
            # One build (seconds, mostly holding the GIL) however many replicas warm up at
            # once; compiles of grammars already cached do not wait for it.
            with self._building:  # every insertion holds it: reading here needs no _lock
                entry = self._backends.get(key)
                if entry is None:
                    entry = (tokenizer, self._factory(tokenizer))
                    with self._lock:
                        self._backends[key] = entry
        return entry[1]

    def get(self, tokenizer: Any, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar; raises `GrammarError` (naming `spec.field`) if it has none."""
        key = (id(tokenizer), int(spec.kind), spec.source)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if entry is None:
            backend = self.backend(tokenizer)
            start = time.perf_counter()
            try:
                entry = backend.compile(spec)
            except GrammarError as exc:
                entry = exc
            seconds = time.perf_counter() - start
            if not isinstance(entry, GrammarError):
                entry.compile_seconds = seconds
            self._on_compile(seconds, not isinstance(entry, GrammarError))
            with self._lock:
                self.misses += 1
                self._entries[key] = entry
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        if isinstance(entry, GrammarError):
            raise GrammarError(spec.field, entry.detail)
        return entry
