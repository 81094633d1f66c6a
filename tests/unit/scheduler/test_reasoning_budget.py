"""The reasoning block as the scheduler enforces it (llmserve.grammar.reasoning), against the
fake model that samples only what each step's mask allows: a thinking budget closes every
block within its tokens plus the closing text, a grammar constrains only what follows the
block, and preemption, migration and forced tokens on or off change nothing.

The tokenizer is SmolLM2's with `<think>` and `</think>` added as tokens (as Qwen3's has
them); the fake model picks among the allowed tokens pseudo-randomly, so it almost never
closes a block by itself: the budget does."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest

from llmserve.errors import FieldError
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.reasoning import ReasoningGrammar, ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from scheduler_service.engine import SamplingParams
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import accumulate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from tests.support.grammar import BOUNDED_SCHEMA, smollm2_tokenizer

from .test_grammar import assert_empty, make_engine, summary

BUDGET = 16


@pytest.fixture(scope="module")
def tok():
    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(LLGuidanceBackend)


@pytest.fixture(scope="module")
def tags(tok):
    open_id, end_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    return open_id, end_id, newline[0]


def spec_of(tags, opened=True, budget: int | None = BUDGET) -> ReasoningSpec:
    open_id, end_id, newline = tags
    return ReasoningSpec((open_id,), (end_id,), (newline, end_id), opened, budget)


SCHEMA = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")


def workload(tags, num=12, seed=3, grammar=None, opened=True):
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 30))]
        if i % 3 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=80)
        elif i % 3 == 1:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=80)
        else:
            params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=80)
        requests.append((f"r{i}", prompt, params, grammar, spec_of(tags, opened)))
    return requests


def run(engine, requests, eos, steps=None):
    for request_id, prompt, params, grammar, reasoning in requests:
        engine.add_request(
            request_id, prompt, params, eos_token_id=eos, grammar=grammar, reasoning=reasoning
        )
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests() and steps != 0:
        for delta in engine.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
        steps = None if steps is None else steps - 1
    return results


def thinking_and_answer(tags, token_ids, opened=True):
    """The tokens inside the block (before the closing text or tag) and those after it."""
    open_id, end_id, newline = tags
    start = 0
    if not opened:
        assert token_ids[0] == open_id
        start = 1
    end = token_ids.index(end_id)
    inside = token_ids[start:end]
    if inside and inside[-1] == newline:
        inside = inside[:-1]
    return inside, token_ids[end + 1 :]


@pytest.mark.parametrize("forced", [True, False])
def test_the_budget_closes_every_block_in_time(tok, cache, tags, forced):
    engine = make_engine(tok, cache, forced=forced)
    requests = workload(tags)
    results = run(engine, requests, tok.eos_token_id)
    assert_empty(engine)
    end_id = tags[1]
    closed = 0
    for request_id, *_ in requests:
        for choice in results[request_id].outputs:
            ids = choice.token_ids
            if end_id not in ids:
                # Only an output that ended (EOS) before its budget was spent.
                assert len(ids) <= BUDGET and choice.finish_reason == FinishReason.STOP, ids
                continue
            inside, answer = thinking_and_answer(tags, ids)
            assert len(inside) <= BUDGET
            closed += 1
            assert answer, "the answer got no tokens"
    assert closed >= 12
    # Forced tokens append the closing text at once; without them, masks allow it alone.
    assert (engine._processor.num_forced_tokens > 0) == forced


def test_a_grammar_constrains_only_the_answer(tok, cache, tags):
    engine = make_engine(tok, cache)
    requests = workload(tags, grammar=SCHEMA)
    results = run(engine, requests, tok.eos_token_id)
    assert_empty(engine)
    for request_id, *_ in requests:
        for choice in results[request_id].outputs:
            assert choice.finish_reason == FinishReason.STOP, (request_id, choice)
            inside, answer = thinking_and_answer(tags, choice.token_ids)
            assert len(inside) <= BUDGET
            # The thinking is free text: not JSON, nothing the schema would allow.
            text = tok.decode(inside, skip_special_tokens=True)
            assert not text.lstrip().startswith("{"), text
            jsonschema.validate(json.loads(tok.decode(answer)), BOUNDED_SCHEMA)


def test_without_an_opened_block_the_model_may_think_or_answer(tok, cache, tags):
    """The prompt did not open the block: the first token opens it or starts the answer,
    which the grammar then constrains from its first token."""
    engine = make_engine(tok, cache)
    requests = workload(tags, num=24, grammar=SCHEMA, opened=False)
    results = run(engine, requests, tok.eos_token_id)
    assert_empty(engine)
    open_id = tags[0]
    thought = answered = 0
    for request_id, *_ in requests:
        for choice in results[request_id].outputs:
            ids = choice.token_ids
            if ids[0] == open_id:
                thought += 1
                _, ids = thinking_and_answer(tags, ids, opened=False)
            else:
                answered += 1
            jsonschema.validate(json.loads(tok.decode(ids)), BOUNDED_SCHEMA)
    assert thought and answered


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_does_not_change_reasoning_outputs(tok, cache, tags, mode):
    requests = workload(tags, num=16, grammar=SCHEMA)
    expected = summary(run(make_engine(tok, cache), requests, tok.eos_token_id))
    small = make_engine(tok, cache, num_gpu_blocks=40, num_cpu_blocks=256, mode=mode)
    got = summary(run(small, requests, tok.eos_token_id))
    assert small.scheduler.num_preemptions[mode] > 0
    assert got == expected
    assert_empty(small)


def test_migrated_requests_replay_their_place_in_the_block(tok, cache, tags):
    requests = workload(tags, grammar=SCHEMA)
    expected = summary(run(make_engine(tok, cache), requests, tok.eos_token_id))
    source, target = make_engine(tok, cache), make_engine(tok, cache)
    results = run(source, requests, tok.eos_token_id, steps=10)  # inside most blocks
    snapshots = source.export_requests()
    assert snapshots and all(s.reasoning is not None for s in snapshots)
    for snapshot in snapshots:
        target.import_request(snapshot)
    while target.has_unfinished_requests():
        for delta in target.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
    assert summary(results) == expected
    assert_empty(source)
    assert_empty(target)


def test_no_budget_and_no_grammar_needs_no_matcher(tok, cache, tags):
    engine = make_engine(tok, cache)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine.add_request("r", [5, 6, 7], params, reasoning=spec_of(tags, budget=None))
    assert engine.scheduler.get_seq_group("r").seqs[0].grammar is None


# -- the matcher alone -----------------------------------------------------------------------


def allowed(matcher, vocab_size):
    bits = int.from_bytes(matcher.bitmask(), "little")
    return {t for t in range(vocab_size) if bits >> t & 1}


def test_matcher_states(tok, cache, tags):
    open_id, end_id, newline = tags
    vocab = len(tok)
    inner = cache.get(tok, GrammarSpec.choice(["yes", "no"], "structured_outputs.choice"))
    grammar = ReasoningGrammar(spec_of(tags, opened=False, budget=3), inner, vocab, {0})
    m = grammar.matcher()
    # Before the block: the grammar's first tokens, or the opening tag.
    before = allowed(m, vocab)
    assert open_id in before and end_id not in before and len(before) < 10
    assert m.accept(open_id) and m.in_reasoning
    # Inside: anything but the stop token (the answer must come).
    inside = allowed(m, vocab)
    assert len(inside) == vocab - 1 and 0 not in inside
    twin = m.copy()
    assert m.accept(100) and m.accept(101) and m.accept(102)
    # Budget spent: the closing text is forced, token by token.
    assert m.forced_tokens() == [newline, end_id]
    assert allowed(m, vocab) == {newline}
    assert not m.accept(103) and m.error()
    # The copy taken before went its own way: it closes the block by itself.
    assert twin.accept(end_id) and not twin.in_reasoning
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert twin.accept(t)
    assert twin.is_terminated()


def test_budget_zero_closes_an_opened_block_at_once(tok, tags):
    grammar = ReasoningGrammar(spec_of(tags, budget=0), None, len(tok))
    assert grammar.matcher().forced_tokens() == [tags[2], tags[1]]


def test_bad_specs_name_their_field(tok, tags):
    open_id, end_id, newline = tags
    with pytest.raises(FieldError, match="close_ids"):
        ReasoningSpec((open_id,), (end_id,), (newline,), True)
    with pytest.raises(FieldError, match="open_ids"):
        ReasoningSpec((), (end_id,), (end_id,), False)
    with pytest.raises(FieldError, match="thinking_token_budget"):
        ReasoningSpec((open_id,), (end_id,), (end_id,), True, -1)
    from llmserve.grammar.backend import GrammarError

    with pytest.raises(GrammarError, match="outside the vocabulary"):
        ReasoningGrammar(ReasoningSpec((10**7,), (end_id,), (end_id,), False), None, len(tok))


@pytest.mark.parametrize("forced", [True, False])
def test_pipelined_reasoning_outputs_equal_synchronous_ones(tok, cache, tags, forced):
    """Asynchronous scheduling runs steps ahead of their results: the closing text forced
    after a continuation was built, and the grammar behind the block, give the same outputs."""
    from scheduler_service.engine.offline import PipelinedStepper

    requests = workload(tags, grammar=SCHEMA)
    expected = summary(run(make_engine(tok, cache, forced=forced), requests, tok.eos_token_id))
    engine = make_engine(tok, cache, forced=forced, hold=0)
    for request_id, prompt, params, grammar, reasoning in requests:
        engine.add_request(
            request_id,
            prompt,
            params,
            eos_token_id=tok.eos_token_id,
            grammar=grammar,
            reasoning=reasoning,
        )
    stepper = PipelinedStepper(engine)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests() or stepper.in_flight:
        for delta in stepper.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
    engine.step()  # the last frees reach the model
    assert summary(results) == expected
    assert stepper.num_continuations > 10
    assert_empty(engine)


def test_an_opening_that_begins_like_the_answer(tok, cache, tags):
    """harmony's opening (`<|channel|>analysis<|message|>`) and its answer's header
    (`<|channel|>final<|message|>`) share their first token: until they part, the output may
    still become either, and the mask allows both continuations."""
    open_id, end_id, newline = tags
    (yes,) = tok.encode("yes", add_special_tokens=False)
    inner = cache.get(
        tok, GrammarSpec.choice(["yes, certainly", "no"], "structured_outputs.choice")
    )
    spec = ReasoningSpec((yes, open_id), (end_id,), (newline, end_id), False, 4)
    grammar = ReasoningGrammar(spec, inner, len(tok))
    m = grammar.matcher()
    assert m.accept(yes)
    after_yes = allowed(m, len(tok))
    comma = tok.encode(",", add_special_tokens=False)[0]
    assert {open_id, comma} <= after_yes and len(after_yes) < 10
    # The block opens: its thinking is free, and the answer starts afresh after it.
    thinking = m.copy()
    assert thinking.accept(open_id) and thinking.in_reasoning
    for t in (100, 101, 102, 103):
        assert thinking.accept(t)
    assert thinking.forced_tokens() == [newline, end_id]
    assert thinking.accept(newline) and thinking.accept(end_id)
    for t in tok.encode("yes, certainly", add_special_tokens=False):
        assert thinking.accept(t)
    assert thinking.is_terminated()
    # Or the first token was the answer's: the rest must be the answer.
    assert m.accept(comma) and not m.in_reasoning
    assert open_id not in allowed(m, len(tok))
    for t in tok.encode(" certainly", add_special_tokens=False):
        assert m.accept(t)
    assert m.is_terminated()
    # A token that is neither is refused.
    fresh = grammar.matcher()
    assert fresh.accept(yes) and not fresh.accept(newline) and fresh.error()
