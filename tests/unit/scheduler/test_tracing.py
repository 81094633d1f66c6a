"""ReplicaTracer on the in-process engine: lifecycle events, step spans, links, sampling."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.fleet import tracing
from scheduler_service.fleet.tracing import (
    ReplicaTracer,
    end_step_span,
    start_request_trace,
    step_traceparent,
)

from .fake_model import FakeModel

BLOCK = 4
SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOT_SAMPLED = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    # Parent-based like the SDK default, but roots are dropped: only the callers' flags count.
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("test"))
    return exporter


def make_engine(gpu: int, mode: PreemptionMode | None = None) -> LLMEngine:
    return LLMEngine(
        # One token a step: the preemptions fall where the tests expect.
        SchedulerConfig(8, 64, 64, True, preemption_mode=mode, decode_steps=1),
        CacheConfig(BLOCK, gpu, 16, watermark=0.0),
        FakeModel(gpu, 16, BLOCK),
    )


def run(engine: LLMEngine, tracer: ReplicaTracer) -> list[str]:
    """The replica's loop, in process. Returns each step's traceparent for the worker."""
    parents = []
    while engine.has_unfinished_requests():
        free = engine.scheduler.block_manager.get_num_free_gpu_blocks()
        sched_out, step = engine.begin_step()
        engine.attach_masks(step)
        span = tracer.step_span(engine, sched_out, step, time.time_ns(), free)
        parents.append(step_traceparent(span))
        result = None if step.is_empty() else engine.executor.execute(step)
        tracer.on_outputs(engine.finish_step(sched_out, step, result))
        end_step_span(span, 0, 0)
    return parents


def by_name(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_prefix_hit_events_and_step_links(exporter: InMemorySpanExporter) -> None:
    engine = make_engine(gpu=16)
    tracer = ReplicaTracer(0, BLOCK)
    prompt = list(range(1, 10))  # two full blocks and one token
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt, params)
    tracer.attach("a", start_request_trace("a", SAMPLED, len(prompt)))
    run(engine, tracer)
    engine.add_request("b", prompt[:8] + [42], params)
    tracer.attach("b", start_request_trace("b", SAMPLED, len(prompt), shard="sched-1:50071"))
    parents = run(engine, tracer)

    a, b = by_name(exporter, "scheduler.request")
    assert [e.name for e in b.events] == [
        "queued",
        "scheduled",
        "prefix_cache_hit",
        "first_token",
        "finished",
    ]
    assert dict(b.events[2].attributes) == {"blocks": 2}
    assert dict(b.events[4].attributes) == {"reason": "length"}
    assert "prefix_cache_hit" not in [e.name for e in a.events]
    assert b.parent.span_id == 0xB7AD6B7169203331
    assert b.attributes["gen_ai.usage.output_tokens"] == 2
    assert b.attributes["llmserve.scheduler.shard"] == "sched-1:50071"  # names its shard
    steps = by_name(exporter, "scheduler.step")
    assert len(steps) == 4  # prefill + decode, twice
    b_steps = [s for s in steps if s.parent.span_id == b.context.span_id]
    assert [[link.context.span_id for link in s.links] for s in b_steps] == [
        [b.context.span_id]
    ] * 2
    assert [s.attributes["llmserve.step.prefill_tokens"] for s in b_steps] == [1, 0]
    assert [s.attributes["llmserve.step.decode_tokens"] for s in b_steps] == [0, 1]
    # The worker's execute span hangs under the step span.
    assert all(p.split("-")[2] in {f"{s.context.span_id:016x}" for s in b_steps} for p in parents)


def test_unsampled_requests_make_no_spans(exporter: InMemorySpanExporter) -> None:
    engine = make_engine(gpu=16)
    tracer = ReplicaTracer(0, BLOCK)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    tracer.attach("a", start_request_trace("a", NOT_SAMPLED, 3))
    assert run(engine, tracer) == ["", "", ""]
    assert exporter.get_finished_spans() == ()


def test_step_parent_is_a_sampled_request_and_links_cover_the_batch(
    exporter: InMemorySpanExporter,
) -> None:
    engine = make_engine(gpu=16)
    tracer = ReplicaTracer(0, BLOCK)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for request_id, traceparent in (("u", NOT_SAMPLED), ("s1", SAMPLED), ("s2", SAMPLED)):
        engine.add_request(request_id, [1, 2, 3], params)
        tracer.attach(request_id, start_request_trace(request_id, traceparent, 3))
    run(engine, tracer)
    s1, s2 = by_name(exporter, "scheduler.request")
    steps = by_name(exporter, "scheduler.step")
    assert len(steps) == 2
    for step in steps:
        assert step.parent.span_id == s1.context.span_id
        assert [link.context.span_id for link in step.links] == [
            s1.context.span_id,
            s2.context.span_id,
        ]
        assert step.attributes["llmserve.step.requests"] == 3


def test_swap_preemption_events(exporter: InMemorySpanExporter) -> None:
    engine = make_engine(gpu=5, mode=PreemptionMode.SWAP)
    tracer = ReplicaTracer(0, BLOCK)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for request_id, first in (("a", 1), ("b", 11)):
        engine.add_request(request_id, list(range(first, first + 5)), params)
        tracer.attach(request_id, start_request_trace(request_id, SAMPLED, 5))
    run(engine, tracer)
    names = {
        s.attributes["llmserve.request_id"]: [e.name for e in s.events]
        for s in by_name(exporter, "scheduler.request")
    }
    assert names["a"] == ["queued", "scheduled", "first_token", "finished"]
    assert names["b"] == [
        "queued",
        "scheduled",
        "first_token",
        "preempted",
        "swapped_out",
        "swapped_in",
        "finished",
    ]
    (b,) = [
        s
        for s in by_name(exporter, "scheduler.request")
        if s.attributes["llmserve.request_id"] == "b"
    ]
    assert dict(b.events[3].attributes) == {"mode": "swap"}
    swapped = [
        s
        for s in by_name(exporter, "scheduler.step")
        if s.attributes["llmserve.step.blocks_swapped_out"]
    ]
    assert len(swapped) == 1
    assert swapped[0].attributes["llmserve.step.preemptions"] == 1


def test_grammar_events_at_the_first_constrained_sample(exporter: InMemorySpanExporter) -> None:
    from llmserve.grammar.cache import GrammarCache
    from llmserve.grammar.llguidance_backend import LLGuidanceBackend
    from llmserve.grammar.spec import GrammarSpec
    from tests.support.grammar import smollm2_tokenizer

    tok = smollm2_tokenizer()
    engine = LLMEngine(
        SchedulerConfig(8, 64, 64, True, decode_steps=1),
        CacheConfig(BLOCK, 32, 16, watermark=0.0),
        FakeModel(32, 16, BLOCK, vocab_size=len(tok)),
        tokenizer=lambda: tok,
        grammar_cache=GrammarCache(LLGuidanceBackend),
    )
    tracer = ReplicaTracer(0, BLOCK)
    spec = GrammarSpec.choice(["yes", "no"], "structured_outputs.choice")
    engine.add_request("g", [5, 6, 7], SamplingParams(max_tokens=8), grammar=spec)
    tracer.attach("g", start_request_trace("g", SAMPLED, 3))
    run(engine, tracer)
    (span,) = by_name(exporter, "scheduler.request")
    names = [e.name for e in span.events]
    assert names == [
        "queued",
        "scheduled",
        "grammar_compiled",
        "first_constrained_sample",
        "first_token",
        "finished",
    ]
    assert span.events[2].attributes["seconds"] > 0
    # The first mask allows every vocabulary token that spells a prefix of a choice.
    prefixes = {w[:i] for w in ("yes", "no") for i in range(1, len(w) + 1)}
    expected = len(prefixes & set(tok.get_vocab()))
    assert dict(span.events[3].attributes) == {"mask_kind": "allow", "mask_tokens": expected}
