"""The Worker gRPC service: a thin layer over `Worker` (proto -> step -> one call -> proto).

The model runs on one dedicated thread (the one that loaded it, see `Worker`) so the event loop
keeps answering health checks and Info while a forward pass is in flight. Steps that arrive
while one runs (asynchronous scheduling sends them ahead) follow it on that thread directly
(`_StepChain`); the loop converts steps and sends results beside them.

A scheduler may come back (restarted) and run the handshake again on a worker that is already
initialized: Info, InitializeCache (same sizes keep the cache, other sizes reallocate it), then
a new Execute stream. The sequence state of the old stream is dropped when that stream ends,
however it ends. While draining (see `worker_service.membership`), new streams are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from llmserve.errors import (
    FailedPreconditionError,
    FieldError,
    ResourceExhaustedError,
    UnavailableError,
)
from llmserve.logs import get_logger
from llmserve.proto_convert import step_input_from_proto, step_result_to_proto
from llmserve.proto_masks import step_masks_from_proto
from llmserve.steps import StepInput, StepResult, TokenMask
from llmserve.telemetry import context_from_traceparent
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service import metrics
from worker_service.late_masks import MaskBoard
from worker_service.worker import Worker

log = get_logger(__name__)
tracer = trace.get_tracer("llmserve.worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one loaded `Worker`. Only one Execute stream may be open at a time."""

    def __init__(
        self,
        worker: Worker,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        model_thread: ThreadPoolExecutor,
    ) -> None:
        self.worker = worker
        self.num_gpu_blocks_available = num_gpu_blocks
        self.num_cpu_blocks_available = num_cpu_blocks
        self.allocated: tuple[int, int] = (0, 0)
        # The single-thread executor that constructed and loaded `worker` (see Worker).
        self._model_thread = model_thread
        self._stream_open = False
        self.draining = False
        # When the last step finished or the stream opened (time.monotonic()), and an event
        # set at each of these and when the stream closes: what the drain waits on.
        self._last_activity = time.monotonic()
        self._activity = asyncio.Event()

    @property
    def stream_open(self) -> bool:
        return self._stream_open

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, quiet_s: float) -> str:
        """Return once the scheduler holds nothing here: the Execute stream is closed, or no
        sequence state is left and no step came for `quiet_s` (see worker_service.membership)."""
        while True:
            self._activity.clear()
            if not self._stream_open:
                return "execute stream closed"
            idle_s = time.monotonic() - self._last_activity
            if self.worker.num_sequences == 0 and idle_s >= quiet_s:
                return "no sequences and no steps"
            # With sequences left, only a step or the stream's end can change the answer.
            timeout = max(quiet_s - idle_s, 0.0) if self.worker.num_sequences == 0 else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._activity.wait(), timeout)

    def _touch(self) -> None:
        self._last_activity = time.monotonic()
        self._activity.set()

    async def _on_model_thread(self, fn, *args):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._model_thread, fn, *args)

    async def Info(
        self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InfoResponse:
        info = self.worker.model_info
        reply = worker_pb2.InfoResponse(
            model=info.model,
            dtype=info.dtype,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            num_gpu_blocks_available=self.num_gpu_blocks_available,
            num_cpu_blocks_available=self.num_cpu_blocks_available,
            num_gpu_blocks=self.allocated[0],
            num_cpu_blocks=self.allocated[1],
            device=info.device,
            attention_backend=info.attention_backend,
            linear_impl=info.linear_impl,
            weight_format=info.weight_format,
            weight_bytes=info.weight_bytes,
        )
        if info.eos_token_id is not None:
            reply.eos_token_id = info.eos_token_id
        return reply

    async def InitializeCache(
        self, request: worker_pb2.InitializeCacheRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InitializeCacheResponse:
        wanted = (request.num_gpu_blocks, request.num_cpu_blocks)
        if request.num_gpu_blocks < 1:
            raise FieldError("num_gpu_blocks", "must be at least 1")
        self._check_holds_max_model_len(request.num_gpu_blocks)
        start = time.perf_counter_ns()
        if wanted != self.allocated:
            if self._stream_open:
                raise FailedPreconditionError(
                    "cannot reallocate the KV cache while an Execute stream is open"
                )
            # More blocks than fit in the configured KV memory are allowed: the scheduler's
            # num_gpu_blocks_override replaces the profiled count, as in vLLM. An allocation
            # that the memory cannot hold fails below instead.
            if (
                wanted[0] > self.num_gpu_blocks_available
                or wanted[1] > self.num_cpu_blocks_available
            ):
                log.warning(
                    "kv cache larger than profiled",
                    num_gpu_blocks=wanted[0],
                    num_gpu_blocks_available=self.num_gpu_blocks_available,
                    num_cpu_blocks=wanted[1],
                    num_cpu_blocks_available=self.num_cpu_blocks_available,
                )
            try:
                # Also drops all sequence state (a new cache holds none).
                await self._on_model_thread(self.worker.initialize_cache, *wanted)
            except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's
                raise ResourceExhaustedError(
                    f"num_gpu_blocks: allocating {wanted[0]} device and {wanted[1]} host "
                    f"blocks failed: {exc}",
                    "num_gpu_blocks",
                ) from exc
            self.allocated = wanted
            metrics.KV_BLOCKS.labels("gpu").set(wanted[0])
            metrics.KV_BLOCKS.labels("cpu").set(wanted[1])
            log.info("kv cache allocated", num_gpu_blocks=wanted[0], num_cpu_blocks=wanted[1])
        return worker_pb2.InitializeCacheResponse(
            num_gpu_blocks=wanted[0],
            num_cpu_blocks=wanted[1],
            init_ns=time.perf_counter_ns() - start,
        )

    def _check_holds_max_model_len(self, num_gpu_blocks: int) -> None:
        """Refuse a cache that cannot hold one sequence of max_model_len: a request allowed
        to grow that long could then never fit. Checked here, at start-up, because the worker
        knows both the model's length and the block size (vLLM's worker checks it too)."""
        info = self.worker.model_info
        needed = -(-info.max_model_len // info.block_size)
        if num_gpu_blocks < needed:
            raise FieldError(
                "num_gpu_blocks",
                f"{num_gpu_blocks} blocks of {info.block_size} tokens cannot "
                f"hold one sequence of max_model_len ({info.max_model_len} tokens, {needed} "
                "blocks); give the worker more KV cache memory, lower its --max-model-len, or "
                "raise --num-gpu-blocks-override",
            )

    async def Execute(
        self,
        request_iterator: AsyncIterator[worker_pb2.ExecuteRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.ExecuteResult]:
        if self.draining:
            raise UnavailableError("this worker is draining and takes no new stream")
        if self._stream_open:
            raise FailedPreconditionError("another Execute stream is already open")
        if self.allocated == (0, 0):
            raise FailedPreconditionError("InitializeCache must be called first")
        self._stream_open = True
        self._touch()
        log.info("execute stream opened", peer=context.peer())
        board = MaskBoard(self.worker.config.mask_wait_timeout_s)
        execute = functools.partial(self._execute, board)
        chain = _StepChain(self._model_thread, execute, asyncio.get_running_loop())
        reader = asyncio.create_task(_read_steps(request_iterator, chain.submit, board.post))
        gap = metrics.ForwardGap()
        try:
            while (outcome := await chain.outcomes.get()) is not None:
                if isinstance(outcome.result, BaseException):
                    raise outcome.result
                result, forward = outcome.result
                gap.observe(outcome.arrived_ns, forward)
                self._touch()
                yield step_result_to_proto(result)
        finally:
            reader.cancel()
            board.close()  # a step waiting for its masks fails now
            chain.close()  # a step running now finishes on the model thread; no later one starts
            # Whatever ended the stream, the scheduler resends every sequence as new. Cleared
            # on the model thread: a step of this stream may still be running there, and any
            # step of a later stream queues behind.
            self._model_thread.submit(self.worker.runner.states.clear)
            self._stream_open = False
            self._touch()
            log.info("execute stream closed")

    def _execute(
        self, board: MaskBoard, received: _Received
    ) -> tuple[StepResult, tuple[int, int] | None]:
        """On the model thread: the step's result and its forward pass's (start, end), inside
        an `execute` span (the child of the scheduler's step span) when the step carries a
        traceparent; raises what a step that could not be read carries. Deferred masks come
        from `board`."""
        step = received.step
        if isinstance(step, BaseException):
            raise step
        if not received.traceparent:
            return self._execute_step(step, board)
        with tracer.start_as_current_span(
            "execute",
            context=context_from_traceparent(received.traceparent),
            kind=trace.SpanKind.SERVER,
        ) as span:
            if step.new_seqs:
                log.debug(
                    "sequences added",
                    step_id=step.step_id,
                    request_ids=sorted({s.request_id for s in step.new_seqs}),
                )
            result, forward = self._execute_step(step, board)
            if span.is_recording():
                span.set_attributes(
                    {
                        "llmserve.step.id": step.step_id,
                        "llmserve.step.tokens": step.num_scheduled_tokens,
                        "llmserve.worker.forward_s": result.forward_ns / 1e9,
                        "llmserve.worker.sample_s": result.sample_ns / 1e9,
                    }
                )
            return result, forward

    def _execute_step(
        self, step: StepInput, board: MaskBoard
    ) -> tuple[StepResult, tuple[int, int] | None]:
        step_id = step.step_id
        result = self.worker.execute(step, lambda: board.take(step_id))
        metrics.observe_step(step.num_scheduled_tokens, result.forward_ns, result.sample_ns)
        if step.deferred_mask_seq_ids:
            metrics.observe_mask_wait(result.mask_wait_ns)
        return result, self.worker.last_forward_ns


@dataclass(slots=True)
class _Received:
    """A step as it arrived on the Execute stream (or why it could not be read)."""

    step: StepInput | BaseException
    traceparent: str
    arrived_ns: int  # time.perf_counter_ns() when it was read off the stream


async def _read_steps(
    requests: AsyncIterator[worker_pb2.ExecuteRequest],
    submit: Callable[[_Received | None], None],
    post_masks: Callable[[int, list[TokenMask]], None],
) -> None:
    """Read steps as they arrive, while earlier ones run (asynchronous scheduling sends the
    next step before the previous result is back), converting them off the model's path;
    deferred masks go to `post_masks`. Ends with None when the stream ends; a step (or masks)
    that fails to convert, or a broken stream, is handed on as its exception."""
    try:
        async for message in requests:
            arrived = time.perf_counter_ns()
            step: StepInput | BaseException
            try:
                if message.HasField("step_masks"):
                    post_masks(*step_masks_from_proto(message.step_masks))
                    continue
                step = step_input_from_proto(message)
            except Exception as exc:  # raised in order, when its turn comes
                step = exc
            submit(_Received(step, message.traceparent, arrived))
    except Exception as exc:  # the stream broke; the Execute loop ends with it
        submit(_Received(exc, "", time.perf_counter_ns()))
    finally:
        submit(None)


@dataclass(slots=True)
class _Outcome:
    """A step's result and forward pass (start, end), or what it raised."""

    result: tuple[StepResult, tuple[int, int] | None] | BaseException
    arrived_ns: int


class _StepChain:
    """One Execute stream's steps, run in order on the model thread, back to back: a step that
    arrived while the previous one ran starts on the model thread right after it, without a
    trip through the event loop. (Measured with the stack on 2 cores, the loop took ~0.3 ms to
    see a result and the model thread ~0.45 ms more to see the next step it was handed.)
    Outcomes go to `outcomes` in order (through a relay thread, see __init__), then None once
    the steps end; a step that raises ends the chain, so no later step runs."""

    def __init__(
        self,
        model_thread: ThreadPoolExecutor,
        execute: Callable[[_Received], tuple[StepResult, tuple[int, int] | None]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.outcomes: asyncio.Queue[_Outcome | None] = asyncio.Queue()
        self._model_thread = model_thread
        self._execute = execute
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: deque[_Received | None] = deque()
        self._running = False  # a `_drain` is queued or running on the model thread
        self._closed = False
        # Outcomes reach the loop through a thread of their own. Handing one to the loop
        # directly wakes it with a write to its self-pipe, and while the model thread was in
        # that write the loop's thread took the GIL to send the result: the next step waited
        # ~0.5 ms for it (1 stream, 2 cores). Queued here instead, an outcome goes to the loop
        # once the model thread lets go of the GIL: in the next forward pass's native code, or
        # when it runs out of steps.
        self._outbox: queue.SimpleQueue[_Outcome | None | _EndOfOutcomes] = queue.SimpleQueue()
        threading.Thread(target=self._relay, name="execute-outcomes", daemon=True).start()

    def submit(self, received: _Received | None) -> None:
        """On the loop: queue a step (None: no more steps)."""
        with self._lock:
            if self._closed:
                return
            self._pending.append(received)
            if self._running:
                return
            self._running = True
        self._model_thread.submit(self._drain)

    def close(self) -> None:
        """No later step starts; outcomes already handed on still reach `outcomes`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
        self._outbox.put(_EndOfOutcomes())

    def _drain(self) -> None:
        """On the model thread: run queued steps until none is left."""
        while True:
            with self._lock:
                if self._closed or not self._pending:
                    self._running = False
                    return
                received = self._pending.popleft()
            if received is None:
                self._post(None)
                continue
            try:
                outcome = _Outcome(self._execute(received), received.arrived_ns)
            except BaseException as exc:  # handed to the Execute loop, which raises it
                self._post(_Outcome(exc, received.arrived_ns))
                self.close()  # the next turn of the loop ends the drain
                continue
            self._post(outcome)

    def _post(self, outcome: _Outcome | None) -> None:
        self._outbox.put(outcome)

    def _relay(self) -> None:
        """On its own thread: hand outcomes to the loop in order, until the chain closes."""
        while not isinstance(outcome := self._outbox.get(), _EndOfOutcomes):
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                self._loop.call_soon_threadsafe(self.outcomes.put_nowait, outcome)


class _EndOfOutcomes:
    """Ends a `_StepChain`'s relay thread."""
