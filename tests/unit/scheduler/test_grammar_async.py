"""Asynchronous scheduling with grammars: constrained requests run ahead of their results
(their masks deferred until the previous step is processed) and give exactly the outputs of
synchronous scheduling, with forced tokens on and off, under preemption; a row whose grammar
forced tokens after its continuation was built samples the first of them (its mask allows
nothing else) and the next continuation computes them all behind the placeholder."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.spec import GrammarSpec
from llmserve.steps import MaskKind
from scheduler_service.engine.offline import PipelinedStepper
from scheduler_service.engine.offline import accumulate as _accumulate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import SequenceStatus
from scheduler_service.engine.speculation import Speculator
from tests.support.drafts import ScriptProposer
from tests.support.grammar import smollm2_tokenizer

from .test_grammar import SCHEMA, assert_empty, assert_matches, make_engine, summary, workload


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(LLGuidanceBackend)


class MaskLog:
    """Wraps an engine's `compute_masks`: per call, the deferred rows whose grammar forced
    tokens after the step was built (their mask allows the first forced token alone), the
    rows that got no mask though running, and how many masks came."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inner = engine.compute_masks
        self.forcing_rows = 0
        self.unmasked_rows = 0
        self.num_masks = 0
        self.num_calls = 0
        engine.compute_masks = self

    def __call__(self, step_id: int):
        step = self.engine.last_step_input
        deferred = list(step.deferred_mask_seq_ids) if step.step_id == step_id else None
        masks, seconds = self.inner(step_id)
        self.num_calls += 1
        self.num_masks += len(masks)
        if deferred is not None:
            running = {
                s.seq_id: s
                for g in self.engine.scheduler.running
                for s in g.seqs
                if s.status == SequenceStatus.RUNNING
            }
            masked = {m.seq_id: m for m in masks}
            self.unmasked_rows += sum(1 for i in deferred if i not in masked and i in running)
            for seq_id in deferred:
                seq, mask = running.get(seq_id), masked.get(seq_id)
                if seq is None or mask is None or mask.kind != MaskKind.ALLOW:
                    continue
                at = seq.num_computed_tokens + 1
                if at < len(seq.token_ids) and mask.token_ids == [seq.token_ids[at]]:
                    self.forcing_rows += 1
        return masks, seconds


def run(engine, requests, eos, pipelined):
    for request_id, prompt, params, spec in requests:
        engine.add_request(request_id, prompt, params, eos_token_id=eos, grammar=spec)
    stepper = PipelinedStepper(engine) if pipelined else None
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests() or (stepper is not None and stepper.in_flight):
        for delta in engine.step() if stepper is None else stepper.step():
            results[delta.request_id] = _accumulate(results.get(delta.request_id), delta)
    engine.step()  # the last frees reach the model
    return results, stepper


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("num_gpu_blocks", [512, 40])
def test_pipelined_constrained_outputs_equal_synchronous_ones(tok, cache, forced, num_gpu_blocks):
    requests = workload(tok, num=16)
    sync_engine = make_engine(tok, cache, forced=forced, num_gpu_blocks=num_gpu_blocks)
    expected, _ = run(sync_engine, requests, tok.eos_token_id, pipelined=False)
    engine = make_engine(tok, cache, forced=forced, num_gpu_blocks=num_gpu_blocks, hold=0)
    log = MaskLog(engine)
    got, stepper = run(engine, requests, tok.eos_token_id, pipelined=True)
    assert summary(got) == summary(expected)
    assert_empty(engine)
    for request_id, _, _, spec in requests:
        for choice in got[request_id].outputs:
            assert_matches(tok, spec, choice.token_ids)
    # Constrained steps did run ahead, each with its masks computed after the step before.
    assert stepper.num_continuations > 10
    assert engine.executor.num_placeholders > 10
    assert engine.executor.num_masked_rows == log.num_masks > 0
    assert log.unmasked_rows == 0
    if not forced:
        assert log.forcing_rows == 0
    elif num_gpu_blocks == 512:  # with few blocks, requests wait and few steps run ahead
        # Forced tokens came after a continuation was built, and the next one sent them.
        assert log.forcing_rows > 0
        assert engine.executor.num_placeholder_runs > 0
    if num_gpu_blocks == 40:
        stats = engine.get_stats()
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0


def test_forced_runs_do_not_break_the_pipeline(tok, cache):
    """JSON keys are forced: a single schema request keeps running ahead through its forced
    runs (each costs it one step: the continuation in flight samples the run's first token
    under a one-token mask), and its output is what synchronous scheduling gives."""
    requests = [r for r in workload(tok, num=8) if r[3] is SCHEMA and r[2].n == 1][:1]
    ((request_id, prompt, params, spec),) = requests
    sync_engine = make_engine(tok, cache)
    expected, _ = run(sync_engine, requests, tok.eos_token_id, pipelined=False)
    engine = make_engine(tok, cache, hold=0)
    log = MaskLog(engine)
    got, stepper = run(engine, requests, tok.eos_token_id, pipelined=True)
    assert summary(got) == summary(expected)
    assert log.forcing_rows > 0 and log.unmasked_rows == 0
    assert engine.executor.num_placeholder_runs == log.forcing_rows
    # Only the prefill (and a last step finishing the request) ran synchronously.
    assert stepper.num_continuations >= engine.executor.num_steps - 3
    assert engine.executor.num_steps - sync_engine.executor.num_steps <= log.forcing_rows + 2


def test_a_step_is_held_while_its_grammar_forced_lately(tok, cache):
    """With forced tokens on, a step whose constrained row got forced tokens within its last
    `forced_hold_tokens` tokens runs synchronously. A window longer than any output holds
    every such step, while an unconstrained request alone is still pipelined; a grammar with
    a forced prefix and a long free tail (regex) is held only at its start by the default
    window, and continued from there on. Every run gives synchronous scheduling's output."""
    constrained = [r for r in workload(tok, num=8) if r[3] is SCHEMA and r[2].n == 1][:1]
    free = [(f"free-{i}", p, params, None) for i, p, params, _ in constrained]
    tail = GrammarSpec.regex("note: [a-z]{40,60}", "structured_outputs.regex")
    ((request_id, prompt, params, _),) = constrained
    regex = [(request_id, prompt, dataclasses.replace(params, max_tokens=80), tail)]
    for requests, hold, continued in (
        (constrained, 10**6, False),
        (free, 10**6, True),
        (regex, 10**6, False),
        (regex, None, True),
    ):
        expected, _ = run(make_engine(tok, cache), requests, tok.eos_token_id, pipelined=False)
        engine = make_engine(tok, cache, hold=hold)
        got, stepper = run(engine, requests, tok.eos_token_id, pipelined=True)
        assert summary(got) == summary(expected)
        assert (stepper.num_continuations > 0) is continued, (requests[0][3], hold)
        if requests is regex and hold is None:
            # The forced prefix and the first 8 tokens after it ran synchronously.
            (choice,) = got[request_id].outputs
            assert stepper.num_continuations < len(choice.token_ids) - 8


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("forced", [True, False])
def test_drafts_under_a_grammar_change_no_output(tok, cache, pipelined, forced):
    """Speculative decoding for constrained requests: drafts are cut where the grammar
    refuses one (or where one would complete it), each draft row samples under the mask after
    the drafts before it, forced tokens follow a kept run. The outputs equal those without
    drafts, every one matches its grammar, and drafts were made and kept."""
    requests = workload(tok, num=16)
    expected, _ = run(make_engine(tok, cache, forced=forced), requests, tok.eos_token_id, False)
    outputs = {
        tuple(prompt): expected[request_id].outputs[0].token_ids
        for request_id, prompt, params, _ in requests
        if params.n == 1
    }
    engine = make_engine(tok, cache, forced=forced)
    scheduler = engine.scheduler
    config = dataclasses.replace(
        scheduler.scheduler_config,
        num_speculative_tokens=4,
        speculative_max_batch=64,
        speculative_max_seqs=64,
    )
    scheduler.speculator = Speculator(
        config,
        scheduler.block_manager,
        # Every third draft position one token off: some drafts kept, some refused by the
        # grammar before they are sent, some sampled otherwise.
        ScriptProposer(outputs, 4, len(tok), off=lambda position: position % 3 == 2),
    )
    got, _ = run(engine, requests, tok.eos_token_id, pipelined)
    assert summary(got) == summary(expected)
    assert_empty(engine)
    for request_id, _, _, spec in requests:
        for choice in got[request_id].outputs:
            assert_matches(tok, spec, choice.token_ids)
    stats = engine.get_stats()
    assert stats.num_spec_draft_tokens > 10
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    # Every draft row of a constrained sequence sampled under its own mask.
    assert engine.executor.num_masked_draft_rows == stats.num_spec_draft_tokens
