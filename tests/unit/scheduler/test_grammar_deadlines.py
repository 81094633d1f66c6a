"""A grammar's compile deadline (`--max-grammar-compile-ms`, scheduler_service/
grammar_requests.py): a compile past it ends its request with 429 and nothing else; a compile
that waited behind the compiler's warm-up (the tokenizer's load, seconds after a scheduler
restart) is timed from the warm-up's end, not from its submission."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmserve.errors import ResourceExhaustedError
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import accumulate as _accumulate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from scheduler_service.fleet.compile_waits import wait_for_compiles
from tests.support.grammar import smollm2_tokenizer

from .fake_model import FakeModel
from .test_grammar import BLOCK, REGEX, assert_empty, assert_matches


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def run_as_the_replica(engine, max_wait_s):
    """The replica loop's order: wait (off the loop) for the compiles the next step needs,
    at most as long as the engine says, then step. Returns the outputs and the sum of the
    waits the engine allowed."""
    results: dict[str, RequestOutput] = {}
    waited = 0.0
    while engine.has_unfinished_requests():
        due, wait_s = engine.grammar_compiles_due()
        if due:
            assert 0.0 < wait_s <= max_wait_s
            asyncio.run(wait_for_compiles(due, wait_s))
            waited += wait_s
            continue
        for delta in engine.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    return results, waited


def test_a_grammar_past_its_compile_deadline_ends_its_request_with_429(tok):
    """A compile still running --max-grammar-compile-ms after its request arrived: the
    request ends with RESOURCE_EXHAUSTED naming the field and the flag, its blocks are
    freed, and the other requests run on. (The backend's compile is held on an event: a
    stand-in for a grammar slow to compile, which no real one is reliably.)"""
    release = threading.Event()

    class StuckBackend(LLGuidanceBackend):
        def compile(self, spec):
            if spec is REGEX:
                release.wait(30)
            return super().compile(spec)

    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                        max_grammar_compile_ms=200),
        CacheConfig(BLOCK, 64, 8, watermark=0.0),
        FakeModel(64, 8, BLOCK, vocab_size=len(tok)),
        tokenizer=lambda: tok,
        grammar_cache=GrammarCache(StuckBackend),
    )  # fmt: skip
    engine.add_request("stuck", [6] * 10, SamplingParams(max_tokens=8), grammar=REGEX)
    engine.add_request("free", [5] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
    try:
        results, waited = run_as_the_replica(engine, max_wait_s=0.2)
    finally:
        release.set()
    assert waited <= 0.2
    error = results["stuck"].error
    assert isinstance(error, ResourceExhaustedError)
    assert error.field == "structured_outputs.regex"
    assert "200 ms" in error.message and "--max-grammar-compile-ms" in error.message
    assert results["stuck"].outputs[0].finish_reason == FinishReason.ABORT
    assert results["stuck"].outputs[0].token_ids == []
    assert len(results["free"].outputs[0].token_ids) == 4
    assert_empty(engine)


def test_a_compile_queued_behind_the_warm_up_is_timed_from_its_end(tok):
    """The tokenizer takes longer to load than the whole compile limit (as after a scheduler
    restart on a busy machine): a request that arrives during the warm-up still gets its
    grammar, where timing it from its arrival would have ended it with 429."""
    loads = []

    def load_tokenizer():  # loaded once, then cached, as the scheduler's loader is
        if not loads:
            time.sleep(0.6)
        loads.append(1)
        return tok

    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                        max_grammar_compile_ms=200),
        CacheConfig(BLOCK, 64, 8, watermark=0.0),
        FakeModel(64, 8, BLOCK, vocab_size=len(tok)),
        tokenizer=load_tokenizer,
        grammar_cache=GrammarCache(LLGuidanceBackend),
    )  # fmt: skip
    engine.warm_grammars()
    engine.add_request("g", [6] * 10, SamplingParams(max_tokens=8), grammar=REGEX)
    start = time.monotonic()
    results, _ = run_as_the_replica(engine, max_wait_s=0.2)
    assert time.monotonic() - start > 0.6  # the warm-up alone outlasted the limit
    assert results["g"].error is None
    assert results["g"].outputs[0].finish_reason != FinishReason.ABORT
    assert_matches(tok, REGEX, results["g"].outputs[0].token_ids)
    assert_empty(engine)
