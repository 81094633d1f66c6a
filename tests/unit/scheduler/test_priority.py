"""Priority scheduling: lower values first (vLLM's convention), and a waiting request of higher
priority preempts running requests of lower priority when the batch is full."""

from __future__ import annotations

import itertools

import pytest

from llmserve.errors import FieldError
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import generate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.snapshots import rebuild_group, snapshot_group
from scheduler_service.engine.text_stops import StopStrings

from .factories import make_seq_group
from .fake_model import FakeModel
from .test_scheduler import make_scheduler, run_step

BLOCK = 4
PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11, 12], "c": [13, 14], "d": [15, 16, 17, 18]}


def make_engine(max_num_seqs: int = 2, num_gpu_blocks: int = 64) -> LLMEngine:
    return LLMEngine(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            max_model_len=64,
            decode_steps=1,  # one token a step: the preemptions fall where the tests expect
        ),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=16),
        FakeModel(num_gpu_blocks, 16, BLOCK),
    )


def alone(request_id: str, max_tokens: int) -> list[int]:
    """The request's output on an engine of its own (nothing preempts it)."""
    engine = make_engine()
    return (
        generate(engine, [PROMPTS[request_id]], SamplingParams(max_tokens=max_tokens))[0]
        .outputs[0]
        .token_ids
    )


class Run:
    """Steps an engine and records every request's tokens and the order they finish in."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.order: list[str] = []
        self.tokens: dict[str, list[int]] = {}

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                self.order.append(out.request_id)

    def step(self) -> None:
        self.record(self.engine.step())

    def begin(self):  # type: ignore[no-untyped-def]
        return self.engine.begin_step()

    def finish(self, sched_out, step_input) -> None:  # type: ignore[no-untyped-def]
        result = self.engine.executor.execute(step_input)
        self.record(self.engine.finish_step(sched_out, step_input, result))

    def to_end(self) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():
            self.step()
        bm = engine.scheduler.block_manager
        assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
        assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


@pytest.mark.parametrize("limit", ["max_num_seqs", "blocks"])
def test_a_high_priority_arrival_at_a_full_batch_preempts_the_lowest_priority_latest_arrival(
    limit,
):
    # The batch is full either by max_num_seqs (2) or by KV blocks (a and b hold every block
    # but the watermark-free remainder c would need).
    engine = make_engine(2, 64) if limit == "max_num_seqs" else make_engine(8, 4)
    params = SamplingParams(max_tokens=8)
    engine.add_request("a", PROMPTS["a"], params, priority=1)
    engine.add_request("b", PROMPTS["b"], params, priority=1)
    run = Run(engine)
    for _ in range(3):
        run.step()
    scheduler = engine.scheduler
    assert [g.request_id for g in scheduler.running] == ["a", "b"]
    engine.add_request("c", PROMPTS["c"], SamplingParams(max_tokens=3), priority=0)
    sched_out, step_input = run.begin()
    # b, the latest arrival of the lowest priority, makes room; a (same priority, earlier)
    # keeps running.
    assert [p.request_id for p in sched_out.preempted] == ["b"]
    assert {s.seq_group.request_id for s in sched_out.scheduled} == {"a", "c"}
    run.finish(sched_out, step_input)
    run.to_end()
    assert run.order[0] == "c"
    # Every request completes with the output it has when nothing disturbs it.
    assert run.tokens == {"a": alone("a", 8), "b": alone("b", 8), "c": alone("c", 3)}


def test_equal_or_higher_priority_is_never_preempted_for_a_waiting_request():
    engine = make_engine(max_num_seqs=2)
    params = SamplingParams(max_tokens=6)
    engine.add_request("a", PROMPTS["a"], params, priority=0)
    engine.add_request("b", PROMPTS["b"], params, priority=-1)
    engine.step()
    engine.add_request("c", PROMPTS["c"], params, priority=0)
    while engine.has_unfinished_requests():
        sched_out, step_input = engine.begin_step()
        assert not sched_out.preempted
        engine.finish_step(sched_out, step_input, engine.executor.execute(step_input))
    assert engine.get_stats().num_preemptions_recompute == 0


def test_the_victim_is_the_lowest_priority_even_when_it_arrived_first():
    engine = make_engine(max_num_seqs=3)
    params = SamplingParams(max_tokens=10)
    engine.add_request("a", PROMPTS["a"], params, priority=5, arrival_time=1.0)
    engine.add_request("b", PROMPTS["b"], params, priority=0, arrival_time=2.0)
    engine.add_request("c", PROMPTS["c"], params, priority=2, arrival_time=3.0)
    run = Run(engine)
    run.step()
    # Running is kept in (priority, arrival) order: the last one is the first victim.
    assert [g.request_id for g in engine.scheduler.running] == ["b", "c", "a"]
    engine.add_request("d", PROMPTS["d"], SamplingParams(max_tokens=2), priority=1)
    sched_out, step_input = run.begin()
    assert [p.request_id for p in sched_out.preempted] == ["a"]
    run.finish(sched_out, step_input)
    run.to_end()
    assert run.order.index("d") < run.order.index("a")
    assert run.tokens["a"] == alone("a", 10)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(gpu=32, max_seqs=1)
    groups = [
        make_seq_group("late-low", [1], arrival_time=1.0),
        make_seq_group("early-high", [2], arrival_time=2.0),
        make_seq_group("late-high", [3], arrival_time=3.0),
    ]
    groups[0].priority = 3
    groups[1].priority = groups[2].priority = -2
    for g in groups:
        s.add_seq_group(g)
    assert [g.request_id for g in s.waiting] == ["early-high", "late-high", "late-low"]
    out = s.schedule()
    assert [x.seq_group.request_id for x in out.scheduled] == ["early-high"]
    run_step(s, out)


def test_a_swapped_group_of_lower_priority_does_not_hold_back_a_waiting_one():
    s = make_scheduler(gpu=4, cpu=8)
    low = make_seq_group("low", [1, 2, 3, 4], arrival_time=0.0)
    low.priority = 1
    s.add_seq_group(low)
    run_step(s, s.schedule())
    parent = low.seqs[0]
    child = parent.fork(998, 1)
    low.add(child)
    s.fork_seq(parent, child, [])
    high = make_seq_group("high", list(range(5, 18)), arrival_time=1.0)
    high.priority = 0
    s.add_seq_group(high)
    out = s.schedule()  # high needs 4 blocks, 3 are free: low (two sequences) is swapped out
    assert [p.request_id for p in out.preempted] == ["low"]
    assert list(s.swapped) == [low]
    assert [x.seq_group.request_id for x in out.scheduled] == ["high"]
    s.block_manager.check_invariants()


def test_migration_snapshots_carry_priority_and_stop_strings():
    stops = StopStrings(("\n\n",), skip_special_tokens=False)
    group = make_seq_group("m", PROMPTS["a"])
    group.priority = -7
    group.stop_strings = stops
    snapshot = snapshot_group(group)
    assert snapshot.priority == -7 and snapshot.stop_strings == stops
    rebuilt = rebuild_group(snapshot, itertools.count().__next__, BLOCK)
    assert rebuilt.priority == -7 and rebuilt.stop_strings == stops
    # A moved request keeps its place among the waiting ones by priority.
    engine = make_engine()
    engine.add_request("w", PROMPTS["b"], SamplingParams(), priority=0)
    snapshot.stop_strings = None
    engine.import_request(snapshot)
    assert [g.request_id for g in engine.scheduler.waiting] == ["m", "w"]


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 1.5, "1"])
def test_priority_must_be_an_int32(priority):
    engine = make_engine()
    with pytest.raises(FieldError) as info:
        engine.add_request("x", [1, 2], SamplingParams(), priority=priority)
    assert info.value.field == "priority"
    assert not engine.has_unfinished_requests()
