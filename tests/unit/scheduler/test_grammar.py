"""Grammar state owned by the scheduler, against a fake model that samples only what each
step's token mask allows: matchers advance on every appended token (sampled or forced), fork
with their sequences, survive preemption and migration by replay, and every output matches
its grammar. The masks are computed from the real llguidance grammar over SmolLM2's
tokenizer; the model's choices among the allowed tokens are pseudo-random."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from llmserve.errors import FieldError
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.spec import GrammarSpec
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import accumulate as _accumulate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from tests.support.grammar import BOUNDED_SCHEMA, smollm2_tokenizer

from .fake_model import FakeModel

BLOCK = 4


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(LLGuidanceBackend)


def make_engine(
    tok,
    cache,
    num_gpu_blocks=512,
    num_cpu_blocks=256,
    forced=True,
    mode=None,
    model_len=256,
    chunked=True,
    caching=True,
    hold=None,
):
    cache_config = CacheConfig(
        BLOCK, num_gpu_blocks, num_cpu_blocks, watermark=0.0, enable_prefix_caching=caching
    )
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64 if chunked else 256,
        max_model_len=model_len,
        enable_chunked_prefill=chunked,
        enable_forced_tokens=forced,
        **({} if hold is None else {"forced_hold_tokens": hold}),
        preemption_mode=mode,
    )
    model = FakeModel(num_gpu_blocks, num_cpu_blocks, BLOCK, vocab_size=len(tok))
    return LLMEngine(sched, cache_config, model, tokenizer=lambda: tok, grammar_cache=cache)


SCHEMA = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")
CHOICE = GrammarSpec.choice(["alpha", "beta", "gamma delta"], "structured_outputs.choice")
REGEX = GrammarSpec.regex(r"[0-9]{2,4}(-[a-c]{1,3})?", "structured_outputs.regex")


def workload(tok, num=12, seed=7):
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 30))]
        spec = [SCHEMA, CHOICE, REGEX][i % 3]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=120)
        elif kind == 1:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=120, logprobs=1)
        elif kind == 2:
            params = SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=120)
        else:
            params = SamplingParams(n=2, best_of=3, temperature=1.0, seed=i, max_tokens=120)
        requests.append((f"r{i}", prompt, params, spec))
    return requests


def run(engine, requests, eos):
    for request_id, prompt, params, spec in requests:
        engine.add_request(request_id, prompt, params, eos_token_id=eos, grammar=spec)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    return results


def assert_empty(engine):
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


def assert_matches(tok, spec, token_ids):
    text = tok.decode(token_ids, skip_special_tokens=True)
    if spec is SCHEMA:
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    elif spec is CHOICE:
        assert text in ("alpha", "beta", "gamma delta")
    else:
        import re

        assert re.fullmatch(r"[0-9]{2,4}(-[a-c]{1,3})?", text), text


def summary(results):
    return {
        rid: [(c.index, c.token_ids, c.finish_reason) for c in out.outputs]
        for rid, out in sorted(results.items())
    }


@pytest.mark.parametrize(("chunked", "caching"), [(True, True), (False, True), (True, False)])
def test_every_output_matches_its_grammar(tok, cache, chunked, caching):
    engine = make_engine(tok, cache, chunked=chunked, caching=caching)
    requests = workload(tok)
    results = run(engine, requests, tok.eos_token_id)
    assert_empty(engine)
    for request_id, _, params, spec in requests:
        out = results[request_id]
        assert len(out.outputs) == params.n
        for choice in out.outputs:
            assert choice.finish_reason == FinishReason.STOP, (request_id, choice)
            assert_matches(tok, spec, choice.token_ids)
    # n > 1: the siblings forked their matchers and went their own ways.
    texts = {c.index: c.token_ids for c in results["r2"].outputs}
    assert len(set(map(tuple, texts.values()))) > 1
    assert engine.executor.num_masked_rows > 0


def test_forced_tokens_are_inputs_not_samples(tok, cache):
    # Single-sequence requests: siblings run in lockstep and are never forced.
    requests = [r for r in workload(tok, num=24) if r[3] is SCHEMA and r[2].best_of == 1]
    assert len(requests) >= 2
    on = make_engine(tok, cache, forced=True)
    off = make_engine(tok, cache, forced=False)
    results_on = run(on, requests, tok.eos_token_id)
    results_off = run(off, requests, tok.eos_token_id)
    for engine, results in ((on, results_on), (off, results_off)):
        assert_empty(engine)
        for request_id, *_ in requests:
            for choice in results[request_id].outputs:
                assert_matches(tok, SCHEMA, choice.token_ids)
    assert on._processor.num_forced_tokens > 0
    assert off._processor.num_forced_tokens == 0
    # Forced runs cost one step each instead of one per token.
    assert on.executor.num_steps < off.executor.num_steps


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_does_not_change_constrained_outputs(tok, cache, mode):
    requests = workload(tok, num=16)
    ample = make_engine(tok, cache)
    expected = summary(run(ample, requests, tok.eos_token_id))
    small = make_engine(tok, cache, num_gpu_blocks=40, num_cpu_blocks=256, mode=mode)
    got = summary(run(small, requests, tok.eos_token_id))
    assert small.scheduler.num_preemptions[mode] > 0
    assert got == expected
    assert_empty(small)


def test_migrated_requests_replay_their_matchers(tok, cache):
    requests = workload(tok)
    expected = summary(run(make_engine(tok, cache), requests, tok.eos_token_id))
    source, target = make_engine(tok, cache), make_engine(tok, cache)
    for request_id, prompt, params, spec in requests:
        source.add_request(request_id, prompt, params, eos_token_id=tok.eos_token_id, grammar=spec)
    results: dict[str, RequestOutput] = {}
    for _ in range(12):  # mid-JSON for most requests
        for delta in source.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    snapshots = source.export_requests()
    assert snapshots and all(s.grammar is not None for s in snapshots)
    assert any(s.seqs and s.seqs[0].output_token_ids for s in snapshots)
    for snapshot in snapshots:
        target.import_request(snapshot)
    while target.has_unfinished_requests():
        for delta in target.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    assert summary(results) == expected
    assert_empty(source)
    assert_empty(target)


def test_a_grammar_that_does_not_compile_finishes_its_request(tok, cache):
    engine = make_engine(tok, cache)
    bad = GrammarSpec.regex("[a-", "structured_outputs.regex")
    results = run(
        engine,
        [
            ("bad", [5, 6, 7], SamplingParams(max_tokens=5), bad),
            ("good", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50), CHOICE),
        ],
        tok.eos_token_id,
    )
    assert results["bad"].outputs[0].finish_reason == FinishReason.ABORT
    assert results["bad"].outputs[0].token_ids == []
    # The client is told why, naming the field (400).
    error = results["bad"].error
    assert isinstance(error, FieldError) and error.field == "structured_outputs.regex"
    assert results["good"].error is None
    assert results["good"].outputs[0].finish_reason == FinishReason.STOP
    assert_empty(engine)


def test_max_tokens_cuts_a_constrained_output_with_length(tok, cache):
    engine = make_engine(tok, cache)
    results = run(
        engine,
        [("cut", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), SCHEMA)],
        tok.eos_token_id,
    )
    choice = results["cut"].outputs[0]
    assert choice.finish_reason == FinishReason.LENGTH
    assert len(choice.token_ids) == 4
    assert tok.decode(choice.token_ids).startswith('{"color": ')
    assert_empty(engine)


def test_beam_search_keeps_a_matcher_per_beam(tok, cache):
    engine = make_engine(tok, cache)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=60)
    results = run(
        engine,
        [("beam", [5, 6, 7], params, REGEX), ("beam-json", [8, 9], params, SCHEMA)],
        tok.eos_token_id,
    )
    for request_id, spec in (("beam", REGEX), ("beam-json", SCHEMA)):
        choices = results[request_id].outputs
        assert len(choices) == 2
        for choice in choices:
            assert choice.finish_reason == FinishReason.STOP, (request_id, choice)
            assert_matches(tok, spec, choice.token_ids)
    assert_empty(engine)


def test_a_continuation_after_a_scheduler_restart_replays_the_grammar(tok, cache):
    """What a gateway re-submits after a restart (the tokens it streamed) continues in a fresh
    engine through fresh matchers, to the same output."""
    from scheduler_service.engine.snapshots import SequenceSnapshot, snapshot_from_choices

    requests = [r for r in workload(tok) if r[2].streams_choices]
    expected = summary(run(make_engine(tok, cache), requests, tok.eos_token_id))
    before = make_engine(tok, cache)
    for request_id, prompt, params, spec in requests:
        before.add_request(request_id, prompt, params, eos_token_id=tok.eos_token_id, grammar=spec)
    results: dict[str, RequestOutput] = {}
    for _ in range(6):
        for delta in before.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    after = make_engine(tok, cache)  # the restarted scheduler: no state but the gateway's
    resumed = 0
    for request_id, prompt, params, spec in requests:
        sent = results.get(request_id)
        if sent is not None and sent.finished:
            continue  # its client has it all: nothing to re-submit
        choices = [
            SequenceSnapshot(
                c.index,
                list(c.token_ids),
                list(c.logprobs or []),
                c.cumulative_logprob,
                c.finish_reason,
                c.stop_token_id,
            )
            for c in (sent.outputs if sent else [])
        ]
        resumed += any(c.output_token_ids and c.finish_reason is None for c in choices)
        after.import_request(
            snapshot_from_choices(
                request_id, prompt, params, tok.eos_token_id, 0.0, choices, 0, None, spec
            )
        )
    assert resumed >= 3, "the restart came too late to cut any output"
    while after.has_unfinished_requests():
        for delta in after.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    assert summary(results) == expected
    assert_empty(after)


def test_a_tokenizer_that_cannot_be_loaded_finishes_the_request(cache):
    def broken():
        raise OSError("tokenizer files not found")

    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(BLOCK, 32, 8, watermark=0.0),
        FakeModel(32, 8, BLOCK, vocab_size=100),
        tokenizer=broken,
        grammar_cache=cache,
    )
    results = run(
        engine,
        [
            ("g", [5, 6, 7], SamplingParams(max_tokens=5), CHOICE),
            ("free", [5, 6, 8], SamplingParams(max_tokens=3, ignore_eos=True), None),
        ],
        None,
    )
    assert results["g"].outputs[0].finish_reason == FinishReason.ABORT
    assert results["g"].outputs[0].token_ids == []
    error = results["g"].error
    assert isinstance(error, FieldError) and error.field == "structured_outputs.choice"
    assert "tokenizer" in error.message
    assert len(results["free"].outputs[0].token_ids) == 3
    assert_empty(engine)


def test_compiles_due_are_those_the_next_step_may_sample_under(tok):
    import threading

    release = threading.Event()

    class SlowBackend(LLGuidanceBackend):
        def compile(self, spec):
            release.wait(5)
            return super().compile(spec)

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    engine = LLMEngine(
        config,
        CacheConfig(BLOCK, 64, 8, watermark=0.0),
        FakeModel(64, 8, BLOCK, vocab_size=len(tok)),
        tokenizer=lambda: tok,
        grammar_cache=GrammarCache(SlowBackend),
    )
    engine.add_request("short", [5] * 10, SamplingParams(max_tokens=8), grammar=CHOICE)
    engine.add_request("long", [6] * 40, SamplingParams(max_tokens=8), grammar=REGEX)
    due, wait_s = engine.grammar_compiles_due()
    # The long prompt needs three 16-token steps before it samples: not due yet. The wait
    # is bounded by the compile's deadline (from its start, so never more than the limit).
    assert len(due) == 1 and not due[0].done()
    assert 0.0 < wait_s <= config.max_grammar_compile_ms / 1000
    release.set()
    due[0].result(timeout=30)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for future in engine.grammar_compiles_due()[0]:
            future.result(timeout=30)
        for delta in engine.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    assert_matches(tok, CHOICE, results["short"].outputs[0].token_ids)
    assert_matches(tok, REGEX, results["long"].outputs[0].token_ids)
    assert engine.grammar_compiles_due() == ([], 0.0)
    assert_empty(engine)


def test_a_token_the_grammar_refuses_aborts_and_is_counted(tok, cache):
    """A worker that did not apply the mask: the scheduler's matcher refuses the token, the
    sequence is aborted, and the refusal is counted."""
    from prometheus_client import REGISTRY

    class MaskDropping(FakeModel):
        def execute(self, step):
            step.token_masks = []
            return super().execute(step)

    def refused() -> float:
        sample = {"stage": "refused_token"}
        return REGISTRY.get_sample_value("llmserve_grammar_errors_total", sample) or 0.0

    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(BLOCK, 32, 8, watermark=0.0),
        MaskDropping(32, 8, BLOCK, vocab_size=len(tok)),
        tokenizer=lambda: tok,
        grammar_cache=cache,
    )
    # Digits only: the fake model's unmasked pick is almost surely not one.
    digits = GrammarSpec.regex(r"[0-9]{4}", "structured_outputs.regex")
    before = refused()
    results = run(engine, [("g", [5, 6, 7], SamplingParams(max_tokens=8), digits)], None)
    (choice,) = results["g"].outputs
    assert choice.finish_reason == FinishReason.ABORT
    assert len(choice.token_ids) == 1
    assert not tok.decode(choice.token_ids).isdigit()
    assert refused() == before + 1
    assert_empty(engine)
