"""Asynchronous scheduling (continuation steps, `PipelinedStepper`) gives exactly the outputs of
synchronous scheduling, as streamed deltas, under preemption, stops, aborts and n > 1; it
frees every block; it streams nothing past a stop; and it does run steps ahead (the fake
model counts the placeholders it filled in)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule

from llmserve.kv_layout import NULL_BLOCK
from llmserve.model_spec import load_tokenizer, resolve_model
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import PipelinedStepper, generate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from scheduler_service.engine.text_stops import StopStrings

from .fake_model import FakeModel
from .test_stateful import EngineMachine
from .test_stop_strings import PROMPT, make_engine, pick_stop, reference

BLOCK = 4
EOS = 0


def workload(num: int, seed: int):
    """Prompts and params: greedy, sampled n > 1 (a fork at the first sample), best_of,
    stop token ids, min_tokens, logprobs; max_tokens up to 40 so that decodes run long."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 64) for _ in range(8)]
    prompts, params = [], []
    for i in range(num):
        body = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 20))]
        prompts.append(shared + body if i % 3 == 0 else body)
        max_tokens = rng.randrange(1, 40)
        kind = i % 5
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
        elif kind == 1:
            p = SamplingParams(n=2, max_tokens=max_tokens)
        elif kind == 2:
            p = SamplingParams(
                max_tokens=max_tokens,
                stop_token_ids=list(range(1, 9)),
                min_tokens=min(2, max_tokens),
            )
        elif kind == 3:
            p = SamplingParams(n=2, best_of=3, max_tokens=max_tokens)
        else:
            p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.append(p)
    return prompts, params


def drive(
    num_gpu_blocks: int,
    pipelined: bool,
    num: int = 60,
    seed: int = 7,
    abort_after: dict[int, int] | None = None,
    setup: Callable[[LLMEngine, FakeModel], None] | None = None,
    make_workload: Callable[[int, int], tuple[list[list[int]], list[SamplingParams]]] = workload,
    **scheduler: Any,
) -> tuple[dict[str, dict[int, tuple[list[int], FinishReason | None]]], LLMEngine, FakeModel]:
    """Requests (`make_workload(num, seed)`) arrive a few at a time (one batch per step while
    any remain); request i is aborted once it has streamed `abort_after[i]` tokens. Returns
    per request, per choice index, the streamed tokens and finish reason, with the engine and
    model. `setup` runs on the new engine; `scheduler`: more `SchedulerConfig` fields."""
    cache = CacheConfig(BLOCK, num_gpu_blocks, 200, watermark=0.0, enable_prefix_caching=True)
    sched = SchedulerConfig(
        max_num_seqs=24, max_num_batched_tokens=64, max_model_len=96, **scheduler
    )
    model = FakeModel(num_gpu_blocks, 200, BLOCK)
    engine = LLMEngine(sched, cache, model)
    if setup is not None:
        setup(engine, model)
    stepper = PipelinedStepper(engine) if pipelined else None
    prompts, params = make_workload(num, seed)
    abort_after = abort_after or {}
    streamed: dict[str, dict[int, tuple[list[int], FinishReason | None]]] = {}
    finished: set[str] = set()
    next_request = 0
    for _ in range(20000):
        if next_request < num:  # a burst of arrivals every step, while they last
            for i in range(next_request, min(num, next_request + 4)):
                engine.add_request(f"r{i}", prompts[i], params[i], eos_token_id=EOS)
            next_request = min(num, next_request + 4)
        in_flight = stepper is not None and stepper.in_flight
        if not engine.has_unfinished_requests() and not in_flight:
            break
        deltas: list[RequestOutput] = engine.step() if stepper is None else stepper.step()
        for delta in deltas:
            assert delta.request_id not in finished, "a delta after the request finished"
            choices = streamed.setdefault(delta.request_id, {})
            for c in delta.outputs:
                tokens, reason = choices.get(c.index, ([], None))
                assert reason is None, "a token streamed past a stop"
                choices[c.index] = (tokens + c.token_ids, c.finish_reason)
            if delta.finished:
                finished.add(delta.request_id)
            index = int(delta.request_id[1:])
            limit = abort_after.get(index)
            if (
                limit is not None
                and not delta.finished
                and sum(len(t) for t, _ in choices.values()) >= limit
            ):
                assert engine.abort_request(delta.request_id)
                finished.add(delta.request_id)
    else:
        raise AssertionError("the engine did not finish")
    engine.step()  # the last frees reach the worker
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == 200
    assert model.seqs == {}
    return streamed, engine, model


@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
def test_pipelined_streams_equal_synchronous_ones(num_gpu_blocks):
    aborts = {5: 2, 6: 4, 7: 1, 9: 5, 14: 7, 24: 3}  # streamed requests
    admitted: list[int] = []  # per continuation, the groups it admitted

    def count_admissions(engine: LLMEngine, _: FakeModel) -> None:
        begin = engine.begin_continuation

        def counted(prev):
            cont = begin(prev)
            if cont is not None:
                admitted.append(cont[0].num_admitted)
            return cont

        engine.begin_continuation = counted  # type: ignore[method-assign]

    sync, sync_engine, _ = drive(num_gpu_blocks, pipelined=False, abort_after=aborts)
    pipe, pipe_engine, model = drive(
        num_gpu_blocks, pipelined=True, abort_after=aborts, setup=count_admissions
    )
    assert pipe == sync
    assert model.num_placeholders > 50  # many decode steps ran ahead of their results
    assert sum(a > 0 for a in admitted) >= 5  # prompts admitted into continuations
    num_aborted = 0
    for i, limit in aborts.items():
        choices = sync[f"r{i}"].values()
        total = sum(len(t) for t, _ in choices)
        if all(r is None for _, r in choices):  # aborted, not finished before the limit
            num_aborted += 1
            assert limit <= total <= limit + 1  # n=2 streams two tokens per step
    assert num_aborted >= 3
    reasons = {r for choices in sync.values() for _, r in choices.values()}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons
    if num_gpu_blocks == 60:
        stats = pipe_engine.get_stats()
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap >= 5


@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_multi_step_streams_equal_single_step_ones(num_gpu_blocks, pipelined):
    """Multi-step decoding (the worker feeding its samples back, four tokens a step) streams
    what single steps stream, stops and min_tokens included, synchronously or with
    continuations, under pressure or not: at every batch size, and only at smaller ones."""
    single, _, _ = drive(num_gpu_blocks, pipelined=False, decode_steps=1)
    for max_seqs in (6, 24):
        multi, engine, model = drive(
            num_gpu_blocks, pipelined=pipelined, decode_steps=4, decode_steps_max_seqs=max_seqs
        )
        assert multi == single
        assert model.num_own_steps > 20
        assert engine.get_stats().num_spec_drafts == 0  # none counted as speculation
        if pipelined:
            assert model.num_after_drafts > 0  # continued before the passes' result came


@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_multi_step_runs_ended_early_stream_what_single_steps_stream(num_gpu_blocks, pipelined):
    """The worker ends multi-step runs after a random number of passes, as when requests
    arrive (`ExecuteRequest.end_passes`): each reads as drafts rejected, the continuation
    built past the run skips the sequence, and the streams equal single steps', with every
    block free at the end (`drive`)."""
    single, _, _ = drive(num_gpu_blocks, pipelined=False, decode_steps=1)
    rng = random.Random(3)

    def ends_runs(_: LLMEngine, model: FakeModel) -> None:
        model.passes_end = lambda: rng.random() < 0.3

    multi, engine, model = drive(
        num_gpu_blocks,
        pipelined=pipelined,
        decode_steps=4,
        decode_steps_max_seqs=24,
        setup=ends_runs,
    )
    assert multi == single
    assert model.num_runs_ended > 20 and model.num_own_steps > 20
    if pipelined:
        # Continuations built past ended runs (fewer under pressure: preemptions make more
        # steps synchronous).
        assert model.num_skipped_after_drafts >= 3
    assert engine.get_stats().num_spec_drafts == 0  # none counted as speculation


def test_generate_pipelined_equals_synchronous_with_max_model_len():
    def run(pipelined: bool):
        cache = CacheConfig(BLOCK, 30, 30, watermark=0.0, enable_prefix_caching=True)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24)
        model = FakeModel(30, 30, BLOCK)
        engine = LLMEngine(sched, cache, model)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11] * 13, [12, 13]]
        params = SamplingParams(n=2, max_tokens=50, ignore_eos=True)
        outs = generate(engine, prompts, params, eos_token_id=EOS, async_scheduling=pipelined)
        engine.step()
        assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 30
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], model

    sync, _ = run(False)
    pipe, model = run(True)
    assert pipe == sync
    assert model.num_placeholders > 0
    for choices, prompt_len in zip(sync, [3, 7, 13, 2], strict=True):
        for tokens, reason in choices:
            assert reason is FinishReason.LENGTH and prompt_len + len(tokens) == 24


def small_engine(max_num_seqs: int) -> LLMEngine:
    cache = CacheConfig(BLOCK, 40, 0, watermark=0.0)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=64,
        decode_steps=1,  # continuations of one token: the tests check their shape
    )
    return LLMEngine(sched, cache, FakeModel(40, 0, BLOCK))


def run_step(engine: LLMEngine, sched_out, step) -> list[RequestOutput]:
    return engine.finish_step(sched_out, step, engine.executor.execute(step))


def test_a_continuation_admits_what_the_budget_leaves_room_for():
    engine = small_engine(max_num_seqs=2)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    run_step(engine, *engine.begin_step())
    sched_out, step = engine.begin_step()
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("c", [6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    cont = engine.begin_continuation(sched_out)
    assert cont is not None
    cont_out, cont_step = cont
    assert [g.seq_group.request_id for g in cont_out.continued()] == ["a"]
    assert [g.seq_group.request_id for g in cont_out.admitted()] == ["b"]  # max_num_seqs=2
    assert [(s.request_id, s.token_ids) for s in cont_step.new_seqs] == [("b", [4, 5])]
    assert cont_out.num_batched_tokens == 1 + 2
    assert [r.request_id for r in engine.scheduler.waiting] == ["c"]
    engine.executor.execute(step)
    assert engine.begin_continuation(sched_out) is None  # one step ahead at most


def test_no_admission_ahead_of_a_higher_priority_request():
    engine = small_engine(max_num_seqs=4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10), priority=1)
    run_step(engine, *engine.begin_step())
    sched_out, _ = engine.begin_step()
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=3), priority=0)
    # A synchronous step would first see whether b must preempt a: no continuation.
    assert engine.begin_continuation(sched_out) is None


def test_a_group_that_finishes_in_the_step_in_flight_is_left_out():
    engine = small_engine(max_num_seqs=4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    run_step(engine, *engine.begin_step())  # each samples its first token
    sched_out, step = engine.begin_step()  # a samples its last
    cont = engine.begin_continuation(sched_out)
    assert cont is not None
    cont_out, cont_step = cont
    assert [g.seq_group.request_id for g in cont_out.scheduled] == ["b"]
    assert cont_out.num_batched_tokens == 1
    (b_seq,) = engine.scheduler.running[1].seqs
    assert [s.seq_id for s in cont_step.cached_seqs] == [b_seq.seq_id]
    outputs = run_step(engine, sched_out, step)
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    assert not run_step(engine, cont_out, cont_step)[0].finished  # b: 3 tokens of 5


def test_no_token_streamed_past_a_stop_string():
    tok = load_tokenizer(resolve_model("smollm2"))
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=3)
    ref = reference(tok, params)
    picked = pick_stop(tok, [c.token_ids for c in ref.outputs], 1)
    assert picked is not None
    stop, _ = picked
    results = []
    for pipelined in (False, True):
        engine, model = make_engine(tok)
        engine.add_request("s", PROMPT, params, stop_strings=StopStrings([stop]))
        stepper = PipelinedStepper(engine) if pipelined else None
        streamed: dict[int, list[int]] = {}
        reasons: dict[int, FinishReason | None] = {}
        while engine.has_unfinished_requests() or (stepper and stepper.in_flight):
            for delta in engine.step() if stepper is None else stepper.step():
                for c in delta.outputs:
                    assert reasons.get(c.index) is None, "a token streamed past a stop"
                    streamed.setdefault(c.index, []).extend(c.token_ids)
                    reasons[c.index] = c.finish_reason
        engine.step()
        assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64
        results.append((streamed, reasons, model.num_placeholders))
    assert results[1][:2] == results[0][:2]
    assert results[0][1][1] is FinishReason.STOP
    assert results[1][2] > 0


class PipelinedEngineMachine(EngineMachine):
    """The stateful add / step / abort machine, stepping one step ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.stepper = PipelinedStepper(self.engine)

    @rule()
    def step(self):
        for out in self.stepper.step():
            if out.finished and out.request_id in self.live:
                self.live.remove(out.request_id)

    def teardown(self):
        engine = self.engine
        for _ in range(2000):
            if not engine.has_unfinished_requests() and not self.stepper.in_flight:
                break
            self.step()
            engine.scheduler.block_manager.check_invariants()
        assert not engine.has_unfinished_requests() and not self.stepper.in_flight
        engine.step()  # flush the last frees to the worker
        bm = engine.scheduler.block_manager
        assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
        assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
        assert engine.executor.seqs == {}


PipelinedEngineMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPipelinedEngineMachine = PipelinedEngineMachine.TestCase


PROMPT_A = [5, 9, 14, 3, 27, 8]


def one_request_engine(windows: tuple[int | None, ...] = (None,)) -> LLMEngine:
    cache = CacheConfig(BLOCK, 60, 0, watermark=0.0, enable_prefix_caching=True, kv_windows=windows)
    sched = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, decode_steps=1
    )
    return LLMEngine(sched, cache, FakeModel(60, 0, BLOCK, windows=windows))


def decode_alone(engine: LLMEngine, pipelined: bool, on_step: Callable[[], None]) -> list[int]:
    """Runs one request of 6 prompt tokens and 20 output tokens to its end; returns them."""
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=20, ignore_eos=True))
    stepper = PipelinedStepper(engine) if pipelined else None
    tokens: list[int] = []
    while engine.has_unfinished_requests() or (stepper is not None and stepper.in_flight):
        for delta in engine.step() if stepper is None else stepper.step():
            tokens += delta.outputs[0].token_ids
        on_step()
    if stepper is not None:
        assert stepper.num_continuations >= 15  # it decoded through continuations
    return tokens


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_blocks_filled_through_continuations_serve_prefix_hits(pipelined):
    """A block a continued sequence fills becomes findable by the prefix cache, as one a
    synchronous step fills: a later prompt made of the first request's tokens hits each of
    its full blocks, from the prompt's into the output's."""
    engine = one_request_engine()
    output = decode_alone(engine, pipelined, lambda: None)
    engine.step()  # the last frees
    prompt = PROMPT_A + output[:12]  # 18 tokens: 4 full blocks, the last 3 of them output
    before = engine.get_stats().prefix_cache_hits
    engine.add_request("b", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits - before == len(prompt) // BLOCK


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_a_continued_sequence_keeps_only_its_window(pipelined):
    """A windowed group's table keeps the blocks the window reads (6 positions: at most 3
    blocks of 4, one more for the slot reserved ahead), whether steps are continued or not,
    and the output is the synchronous one."""
    windows = (None, 6)
    engine = one_request_engine(windows)
    bm = engine.scheduler.block_manager
    live: list[int] = []

    def count_live() -> None:
        for group in engine.scheduler.running:
            table = bm.get_block_table(group.seqs[0], 1)
            live.append(sum(b != NULL_BLOCK for b in table))

    output = decode_alone(engine, pipelined, count_live)
    assert output == decode_alone(one_request_engine(windows), False, lambda: None)
    assert len(live) >= 15 and max(live) <= 4


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_a_step_that_admits_a_prompt_takes_no_multi_step_passes(pipelined):
    """Multi-step passes would hold a prompt's first token back until the last of them: the
    step that admits one gives the running sequence no placeholders, whether it is built
    synchronously or as a continuation, and the passes resume once both decode."""
    cache = CacheConfig(BLOCK, 60, 0, watermark=0.0, enable_prefix_caching=True)
    sched = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, decode_steps=4
    )
    engine = LLMEngine(sched, cache, FakeModel(60, 0, BLOCK))
    built: list[Any] = []  # every step's scheduling decision, in order

    def record(begin: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any) -> Any:
            step = begin(*args)
            if step is not None:
                built.append(step[0])
            return step

        return recorded

    engine.begin_step = record(engine.begin_step)  # type: ignore[method-assign]
    engine.begin_continuation = record(engine.begin_continuation)  # type: ignore[method-assign]
    stepper = PipelinedStepper(engine) if pipelined else None
    step = engine.step if stepper is None else stepper.step
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        step()
    assert built[-1].drafts  # a alone: multi-step passes
    engine.add_request("b", [7, 7, 3, 1, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    first_b = len(built)
    b_tokens: list[int] = []
    while not b_tokens:
        for delta in step():
            if delta.request_id == "b":
                b_tokens += delta.outputs[0].token_ids
    admitting = next(out for out in built[first_b:] if "b" in requests(out))
    assert requests(admitting) == ["a", "b"] and not admitting.drafts
    while engine.has_unfinished_requests() or (stepper is not None and stepper.in_flight):
        step()
    later = built[built.index(admitting) + 1 :]
    assert any(out.drafts and requests(out) == ["a", "b"] for out in later)  # passes resume


def requests(out: Any) -> list[str]:
    return [s.seq_group.request_id for s in out.scheduled]
