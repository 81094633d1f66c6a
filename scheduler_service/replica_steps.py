"""A replica's steps on the wire: begun, sent on the Execute stream, received, finished.

With asynchronous scheduling (`ReplicaConfig.async_scheduling`) up to two steps are in
flight: while the worker runs step N, step N+1 is built as N's continuation
(`LLMEngine.begin_continuation`) and sent, so the worker starts it as soon as N is done,
without waiting for N's result to travel back, be processed and the next step to be
scheduled. Results are received and finished in order; each step keeps its own trace span,
metrics and watchdog timing (a step's time runs from when the worker can start it: its send,
or the previous result, whichever is later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from opentelemetry.trace import Span

from llmserve import failpoints
from llmserve.proto_convert import step_input_to_proto, step_result_from_proto
from llmserve.steps import StepInput
from scheduler_service import metrics
from scheduler_service.engine import LLMEngine
from scheduler_service.outputs import RequestOutput
from scheduler_service.scheduler_outputs import SchedulerOutputs
from scheduler_service.tracing import ReplicaTracer, end_step_span, step_traceparent
from scheduler_service.worker_link import ExecuteStream, StepWatchdog


@dataclass(slots=True)
class _Step:
    sched_out: SchedulerOutputs
    step_input: StepInput
    span: Span | None
    request_ids: list[str]
    sent: float  # perf_counter at send (or at begin, for an empty step)
    mask_seconds: float = 0.0  # building its token masks (structured output)


class StepPipeline:
    """The steps of one connected replica (one engine, one stream), oldest first."""

    def __init__(
        self,
        replica_id: int,
        address: str,
        engine: LLMEngine,
        stream: ExecuteStream,
        tracer: ReplicaTracer,
        watchdog: StepWatchdog,
        async_scheduling: bool,
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.engine = engine
        self.stream = stream
        self.tracer = tracer
        self.watchdog = watchdog
        self.async_scheduling = async_scheduling
        self._steps: deque[_Step] = deque()
        self._last_finished = 0.0
        self.num_continuations = 0

    @property
    def in_flight(self) -> int:
        return len(self._steps)

    def request_ids(self) -> list[str]:
        """The requests of the steps in flight (each once)."""
        if len(self._steps) == 1:
            return self._steps[0].request_ids
        return list(dict.fromkeys(r for step in self._steps for r in step.request_ids))

    def begin(self) -> None:
        """Schedule a step (nothing may be in flight) and send it unless it is empty."""
        engine = self.engine
        started_ns = time.time_ns()
        free_before = engine.scheduler.block_manager.get_num_free_gpu_blocks()
        sched_out, step_input = engine.begin_step()
        self._send(sched_out, step_input, started_ns, free_before)

    def try_continue(self) -> bool:
        """With one step in flight: build and send its continuation, if it has one."""
        if not self.async_scheduling or len(self._steps) != 1:
            return False
        engine = self.engine
        started_ns = time.time_ns()
        free_before = engine.scheduler.block_manager.get_num_free_gpu_blocks()
        cont = engine.begin_continuation(self._steps[0].sched_out)
        if cont is None:
            return False
        self.num_continuations += 1
        self._send(*cont, started_ns, free_before)
        return True

    def _send(
        self, sched_out: SchedulerOutputs, step_input: StepInput, started_ns: int, free: int
    ) -> None:
        span = self.tracer.step_span(self.engine, sched_out, step_input, started_ns, free)
        ids = [s.seq_group.request_id for s in sched_out.scheduled]
        if not step_input.is_empty():
            request = step_input_to_proto(step_input)
            request.traceparent = step_traceparent(span)
            self.stream.send(request)
        self._steps.append(
            _Step(
                sched_out,
                step_input,
                span,
                ids,
                time.perf_counter(),
                self.engine.last_mask_seconds if step_input.token_masks else 0.0,
            )
        )

    async def finish_oldest(self) -> tuple[list[RequestOutput], bool]:
        """Receive the oldest step's result and finish it. Returns its outputs and whether
        the step was empty."""
        step = self._steps[0]
        result = None
        if not step.step_input.is_empty():
            try:
                reply = await self.stream.receive(self.watchdog.timeout_s())
            except BaseException as exc:
                for pending in self._steps:
                    end_step_span(pending.span, 0, 0, exc)
                raise
            result = step_result_from_proto(reply)
        failpoints.check("replica.finish_step", self.address)
        self._steps.popleft()
        engine = self.engine
        outputs = engine.finish_step(step.sched_out, step.step_input, result)
        self.tracer.on_outputs(outputs)
        end_step_span(step.span, *((result.forward_ns, result.sample_ns) if result else (0, 0)))
        now = time.perf_counter()
        seconds = now - max(step.sent, self._last_finished)
        self._last_finished = now
        self.watchdog.observe(seconds)
        metrics.record_step(
            self.replica_id,
            engine.get_stats(),
            step.step_input,
            result,
            seconds,
            engine.last_num_generated,
        )
        metrics.record_grammar_step(
            self.replica_id,
            step.step_input,
            step.mask_seconds,
            engine.num_forced_tokens,
        )
        return outputs, step.step_input.is_empty()
