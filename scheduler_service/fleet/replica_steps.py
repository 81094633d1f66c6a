"""A replica's steps on the wire: begun, sent on the Execute stream, received, finished.

With asynchronous scheduling (`ReplicaConfig.async_scheduling`) up to two steps are in
flight: while the worker runs step N, step N+1 is built as N's continuation
(`LLMEngine.begin_continuation`) and sent, so the worker starts it as soon as N is done,
without waiting for N's result to travel back, be processed and the next step to be
scheduled. Results are received and finished in order; each step keeps its own trace span,
metrics and watchdog timing (a step's time runs from when the worker can start it: its send,
or the previous result, whichever is later).

A step with constrained rows (structured output) goes out with them deferred; their masks are
computed off the event loop while the worker runs the step's forward pass and follow on the
same stream (`_send_masks`): at once for a step begun alone, once the previous step is
finished for a continuation (its masks need that step's tokens). A step is finished only
after its masks went out, so nothing advances those grammars while they are computed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Span

from llmserve import failpoints
from llmserve.proto_masks import step_masks_to_proto
from llmserve.step_proto import step_input_to_proto, step_result_from_proto
from llmserve.steps import StepInput
from llmserve.v1 import worker_pb2
from scheduler_service.engine import metrics
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs
from scheduler_service.fleet.tracing import ReplicaTracer, end_step_span, step_traceparent
from scheduler_service.fleet.transfer_queue import TransferNews, TransferQueue, transfer_news
from scheduler_service.fleet.worker_link import ExecuteStream, StepWatchdog


@dataclass(slots=True)
class _Step:
    sched_out: SchedulerOutputs
    step_input: StepInput
    span: Span | None
    request_ids: list[str]
    sent: float  # perf_counter at send (or at begin, for an empty step)
    # Computing and sending its deferred masks (structured output); resolves to the seconds
    # the computation took and how many masks went out. None: none started (no deferred
    # rows, or waiting for the previous step).
    masks: asyncio.Future[tuple[float, int]] | None = None
    # Its multi-step runs were told to end early (`StepPipeline.end_passes`).
    passes_ended: bool = False


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
        transfers: TransferQueue,
        after_step: Callable[[TransferNews | None, int, float], None],
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.engine = engine
        self.stream = stream
        self.tracer = tracer
        self.watchdog = watchdog
        self.async_scheduling = async_scheduling
        # KV transfer maps ride on whichever step goes next; `after_step` hears of every
        # finished step: its news of them, the tokens it computed and its seconds.
        self.transfers = transfers
        self.after_step = after_step
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
        self.transfers.attach(step_input)
        if not step_input.is_empty():
            request = step_input_to_proto(step_input)
            request.traceparent = step_traceparent(span)
            self.stream.send(request)
        step = _Step(sched_out, step_input, span, ids, time.perf_counter())
        if not self._steps:  # else a continuation: its masks wait for the step before it
            self._start_masks(step)
        self._steps.append(step)

    def end_passes(self) -> None:
        """A request arrived: the multi-step runs in flight end after the pass the worker is
        running (`ExecuteRequest.end_passes`), so that the step admitting it need not wait
        for the rest of their passes. Output processing reads an ended run as drafts
        rejected, and drops its sequence from the continuation built past it
        (`llmserve.steps`). Said once for each step."""
        if not self.engine.scheduler.speculator.own_samples:
            return
        through = -1
        for step in self._steps:
            if step.sched_out.drafts and not step.passes_ended:
                step.passes_ended = True
                through = step.step_input.step_id
        if through >= 0:
            self.stream.send(
                worker_pb2.ExecuteRequest(end_passes=worker_pb2.EndPasses(through_step_id=through))
            )

    def _start_masks(self, step: _Step) -> None:
        if step.step_input.deferred_mask_seq_ids:
            step.masks = asyncio.ensure_future(self._send_masks(step))

    async def _send_masks(self, step: _Step) -> tuple[float, int]:
        """Compute the step's deferred masks on a thread (the loop meanwhile sends the step
        and goes on) and send them after it. Returns the seconds the computation took and the
        number of masks."""
        step_id = step.step_input.step_id
        loop = asyncio.get_running_loop()
        masks, seconds = await loop.run_in_executor(None, self.engine.compute_masks, step_id)
        self.stream.send(step_masks_to_proto(step_id, masks))
        self.tracer.on_masks(step.sched_out, masks)
        return seconds, len(masks)

    async def finish_oldest(self) -> tuple[list[RequestOutput], bool]:
        """Receive the oldest step's result and finish it, sending the continuation of the
        step left in flight first if it has one. Returns its outputs and whether the step was
        empty."""
        step = self._steps[0]
        result = None
        mask_seconds, num_masks = 0.0, len(step.step_input.token_masks)
        try:
            if step.masks is not None:
                mask_seconds, num_masks = await step.masks
            if not step.step_input.is_empty():
                reply = await self.stream.receive(self.watchdog.timeout_s())
                result = step_result_from_proto(reply)
        except BaseException as exc:
            for pending in self._steps:
                end_step_span(pending.span, 0, 0, exc)
                if pending.masks is not None and pending is not step:
                    pending.masks.cancel()
            raise
        failpoints.check("replica.finish_step", self.address)
        self._steps.popleft()
        engine = self.engine
        outputs = engine.finish_step(step.sched_out, step.step_input, result)
        if self._steps:  # a continuation: its masks can be computed now
            self._start_masks(self._steps[0])
            # Its own continuation is queued before this step's outputs go to the fleet, so the
            # stream's writer, woken first, sends it before they are handled: while the worker
            # runs the step in flight, every process here shares its cores, and the next step
            # should be waiting when that step's pass ends. (No await here: a cancellation
            # must not find a step finished and its outputs not returned.)
            self.try_continue()
        self.tracer.on_outputs(outputs)
        end_step_span(
            step.span,
            *((result.forward_ns, result.sample_ns) if result else (0, 0)),
            accepted_drafts=(
                engine.last_num_accepted_drafts
                if step.sched_out.drafts and not engine.scheduler.speculator.own_samples
                else None
            ),
        )
        now = time.perf_counter()
        seconds = now - max(step.sent, self._last_finished)
        self._last_finished = now
        self.watchdog.observe(seconds)
        news = transfer_news(step.step_input, result)
        self.after_step(news, step.step_input.num_scheduled_tokens, seconds)
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
            num_masks,
            mask_seconds,
            engine.num_forced_tokens,
        )
        return outputs, step.step_input.is_empty()
