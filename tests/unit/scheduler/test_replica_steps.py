"""A replica's steps on the wire (scheduler_service/fleet/replica_steps.py): with one step in
flight after a step finishes, its continuation goes to the worker before the finished step is
accounted for (the `after_step` report and the outputs the caller hands on), so the worker
finds its next step queued; the outputs are those of a synchronous run. A request arriving
while multi-step runs are in flight tells the worker to end them (`end_passes`)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from llmserve.step_proto import step_input_from_proto, step_result_to_proto
from llmserve.v1 import worker_pb2
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import generate
from scheduler_service.fleet.fleet_config import ReplicaConfig
from scheduler_service.fleet.replica_steps import StepPipeline
from scheduler_service.fleet.tracing import ReplicaTracer
from scheduler_service.fleet.transfer_queue import TransferQueue
from scheduler_service.fleet.worker_link import StepWatchdog

from .fake_model import FakeModel

BLOCK = 4
PROMPT = [5, 9, 2, 7, 7, 1]
MAX_TOKENS = 12


class LoggedStream:
    """An Execute stream whose worker is a FakeModel run at send: logs each step sent."""

    def __init__(self, model: FakeModel, log: list[tuple[str, int]]) -> None:
        self.model = model
        self.log = log
        self.results: deque[worker_pb2.ExecuteResult] = deque()

    def send(self, request: worker_pb2.ExecuteRequest) -> None:
        if request.HasField("end_passes"):  # not a step: the worker ran its passes already
            self.log.append(("end_passes", request.end_passes.through_step_id))
            return
        step = step_input_from_proto(request)
        self.log.append(("sent", step.step_id))
        if any(c.draft_token_ids for c in step.cached_seqs):
            self.log.append(("passes", step.step_id))
        self.results.append(step_result_to_proto(self.model.execute(step)))

    async def receive(self, timeout_s: float) -> worker_pb2.ExecuteResult:
        return self.results.popleft()


def make_engine(decode_steps: int = 1) -> tuple[LLMEngine, FakeModel]:
    model = FakeModel(64, 0, BLOCK)
    engine = LLMEngine(
        # One token a step by default: the first test counts the steps continued.
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=128,
            decode_steps=decode_steps,
        ),
        CacheConfig(BLOCK, 64, 0, watermark=0.0, enable_prefix_caching=False),
        model,
    )
    return engine, model


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_pipeline(engine: LLMEngine, model: FakeModel, log: list[tuple[str, int]]) -> StepPipeline:
    config = ReplicaConfig(engine.scheduler_config)
    return StepPipeline(
        0,
        "fake:0",
        engine,
        LoggedStream(model, log),  # type: ignore[arg-type]
        ReplicaTracer(0, BLOCK),
        StepWatchdog(config),
        True,
        TransferQueue(lambda: None),
        lambda news, tokens, seconds: log.append(("finished", tokens)),
    )


def test_the_continuation_goes_out_before_the_finished_step_is_reported() -> None:
    engine, model = make_engine()
    log: list[tuple[str, int]] = []
    pipe = make_pipeline(engine, model, log)
    engine.add_request("r", PROMPT, params())
    tokens: list[int] = []
    continued_early = 0  # steps whose finish sent the next continuation

    async def run() -> None:
        nonlocal continued_early
        pipe.begin()
        while pipe.in_flight:
            pipe.try_continue()
            sent_before = sum(kind == "sent" for kind, _ in log)
            outputs, _ = await pipe.finish_oldest()
            for output in outputs:  # deltas
                tokens.extend(output.outputs[0].token_ids)
            if pipe.in_flight == 2:  # the step left in flight had a continuation: it was sent
                continued_early += 1
                assert sum(kind == "sent" for kind, _ in log) == sent_before + 1
                assert log[-2][0] == "sent" and log[-1][0] == "finished"

    asyncio.run(run())
    assert continued_early >= MAX_TOKENS - 3
    sync_engine, _ = make_engine()
    (expected,) = generate(sync_engine, [PROMPT], params())
    assert tokens == expected.outputs[0].token_ids


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_an_arrival_ends_the_multi_step_runs_in_flight_once(decode_steps: int) -> None:
    """`end_passes` (a request arrived) names the last step in flight with multi-step runs,
    once for each such step, and says nothing while none is in flight; the tokens are a
    synchronous run's (the fake worker runs every pass: the word comes too late for it)."""
    engine, model = make_engine(decode_steps)
    log: list[tuple[str, int]] = []
    pipe = make_pipeline(engine, model, log)
    engine.add_request("r", PROMPT, params())
    tokens: list[int] = []
    named: list[int] = []  # what end_passes should have named, in order

    def ended() -> list[int]:
        return [step_id for kind, step_id in log if kind == "end_passes"]

    async def run() -> None:
        while engine.has_unfinished_requests():
            if not pipe.in_flight:
                pipe.begin()
            pipe.try_continue()
            sent = [step_id for kind, step_id in log if kind == "sent"]
            with_passes = {step_id for kind, step_id in log if kind == "passes"}
            runs = [i for i in sent[-pipe.in_flight :] if i in with_passes]
            if runs and max(runs) > max(named, default=-1):  # a run not yet told to end
                named.append(max(runs))
            pipe.end_passes()
            pipe.end_passes()
            assert ended() == named  # said once, when there were runs
            outputs, _ = await pipe.finish_oldest()
            for output in outputs:
                tokens.extend(output.outputs[0].token_ids)

    asyncio.run(run())
    assert (len(named) > 1) == (decode_steps > 1)
    sync_engine, _ = make_engine(decode_steps)
    (expected,) = generate(sync_engine, [PROMPT], params())
    assert tokens == expected.outputs[0].token_ids and len(tokens) == MAX_TOKENS
