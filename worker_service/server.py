"""The Worker gRPC service: a thin layer over `Worker` (proto -> step -> one call -> proto).

The model runs on one dedicated thread (the one that loaded it, see `Worker`) so the event loop
keeps answering health checks and Info while a forward pass is in flight. Steps that arrive
while one runs (asynchronous scheduling sends them ahead) follow it on that thread directly
(`StepChain`, step_chain.py); the loop converts steps and sends results beside them.

A scheduler may come back (restarted) and run the handshake again on a worker that is already
initialized: Info, InitializeCache (same sizes and batch limits keep the cache, others
reallocate it, other limits after a new profile run), then a new Execute stream. The sequence
state of the old stream is dropped when that stream ends, however it ends. While draining
(see `worker_service.membership`), new streams are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from llmserve import failpoints
from llmserve.batch_limits import BatchLimits
from llmserve.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    FieldError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from llmserve.logs import get_logger
from llmserve.proto_convert import batch_limits_from_proto
from llmserve.step_proto import step_result_to_proto
from llmserve.steps import StepInput, StepResult
from llmserve.telemetry import context_from_traceparent
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service import metrics
from worker_service.late_masks import MaskBoard
from worker_service.step_chain import PassesEnd, Received, StepChain, read_steps

if TYPE_CHECKING:  # not at run time: the simulated worker (tests/support) serves without torch
    from worker_service.worker import Worker

log = get_logger(__name__)

# Why a second Execute stream (or a cache reallocation under the first) is refused.
HELD_MESSAGE = "an Execute stream is open: a scheduler already drives this worker"
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
        # Bytes per second ReadBlocks sends at most (0: no cap; --kv-send-rate-gbs).
        self.kv_send_rate = 0.0
        # What the scheduler uses this worker for (--role; worker_pb2.WorkerRole).
        self.role = worker_pb2.WORKER_ROLE_MIXED
        # Called when an Execute stream ends (the lease keeper then registers again at once).
        self.on_stream_closed: Callable[[], None] = lambda: None

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
            execute_stream_open=self._stream_open,
            role=self.role,
        )
        if info.eos_token_id is not None:
            reply.eos_token_id = info.eos_token_id
        for group in info.kv_layout.groups:
            reply.kv_groups.add(sliding_window=group.sliding_window, layers=group.layers)
        reply.kv_group_blocks_used.extend(self.worker.group_blocks_used())
        reply.state_layers.extend(info.kv_layout.state_layers)
        return reply

    async def InitializeCache(
        self, request: worker_pb2.InitializeCacheRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InitializeCacheResponse:
        limits = self.worker.batch_limits_for(batch_limits_from_proto(request))
        given = request.HasField("num_gpu_blocks")
        if given:  # checked before any profile run: a refusal costs nothing
            if request.num_gpu_blocks < 1:
                raise FieldError("num_gpu_blocks", "must be at least 1")
            self._check_holds_max_model_len(request.num_gpu_blocks)
        start = time.perf_counter_ns()
        if limits != self.worker.batch_limits:
            await self._use_batch_limits(limits)
        log.info(
            "batch limits adopted",
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
        )
        # Absent, as many as fit beside the largest step under these limits.
        num_gpu = request.num_gpu_blocks if given else self.num_gpu_blocks_available
        if not given:
            self._check_holds_max_model_len(num_gpu)
        wanted = (num_gpu, request.num_cpu_blocks)
        if wanted != self.allocated:
            if self._stream_open:
                raise AlreadyExistsError(f"cannot reallocate the KV cache: {HELD_MESSAGE}")
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
            self._set_allocated(wanted)
            log.info("kv cache allocated", num_gpu_blocks=wanted[0], num_cpu_blocks=wanted[1])
        return worker_pb2.InitializeCacheResponse(
            num_gpu_blocks=wanted[0],
            num_cpu_blocks=wanted[1],
            init_ns=time.perf_counter_ns() - start,
            num_state_slots=self.worker.num_state_slots,
        )

    async def _use_batch_limits(self, limits: BatchLimits) -> None:
        """Run under other batch limits: the worker drops its cache and profiles again for
        them (CUDA), which sets the blocks it offers."""
        if self._stream_open:
            raise AlreadyExistsError(f"cannot change the batch limits: {HELD_MESSAGE}")
        self._set_allocated((0, 0))  # the cache goes first
        try:
            available = await self._on_model_thread(self.worker.use_batch_limits, limits)
        except RuntimeError as exc:  # torch.OutOfMemoryError in the profile run
            raise ResourceExhaustedError(
                f"max_num_batched_tokens: profiling a step of {limits.max_num_batched_tokens} "
                f"tokens in {limits.max_num_seqs} sequences failed: {exc}",
                "max_num_batched_tokens",
            ) from exc
        self.num_gpu_blocks_available, self.num_cpu_blocks_available = available
        log.info(
            "kv capacity",
            num_gpu_blocks=available[0],
            num_cpu_blocks=available[1],
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
        )

    def _set_allocated(self, blocks: tuple[int, int]) -> None:
        self.allocated = blocks
        metrics.KV_BLOCKS.labels("gpu").set(blocks[0])
        metrics.KV_BLOCKS.labels("cpu").set(blocks[1])

    def _check_holds_max_model_len(self, num_gpu_blocks: int) -> None:
        """Refuse a cache that cannot hold one sequence of max_model_len: a request allowed
        to grow that long could then never fit. Checked here, at start-up, because the worker
        knows both the model's length and the block size (vLLM's worker checks it too)."""
        info = self.worker.model_info
        layout = info.kv_layout
        # A decode step at max_model_len (a windowed group holds its window's blocks), and
        # the null block a windowed layout reserves.
        needed = layout.blocks_for(info.max_model_len, info.block_size, chunk=1)
        needed += int(layout.reserves_null_block)
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
            raise AlreadyExistsError(HELD_MESSAGE)
        if self.allocated == (0, 0):
            raise FailedPreconditionError("InitializeCache must be called first")
        self._stream_open = True
        self._touch()
        log.info("execute stream opened", peer=context.peer())
        board = MaskBoard(self.worker.config.mask_wait_timeout_s)
        passes_end = PassesEnd()
        execute = functools.partial(self._execute, board, passes_end)
        chain = StepChain(self._model_thread, execute, asyncio.get_running_loop())
        reader = asyncio.create_task(
            read_steps(request_iterator, chain.submit, board.post, passes_end.post)
        )
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
            self._model_thread.submit(self.worker.exports.clear)  # its transfers end with it
            self._stream_open = False
            self._touch()
            log.info("execute stream closed")
            self.on_stream_closed()

    async def ReadBlocks(
        self, request: worker_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.BlockChunk]:
        from worker_service.kv_transfer import data_chunks, header, read_export  # torch

        exports = self.worker.exports
        block_ids = exports.blocks.get(request.transfer_id)
        state_slot = exports.state_slots.get(request.transfer_id)
        cache = self.worker.cache_engine  # None before InitializeCache
        if block_ids is None or cache is None:
            raise NotFoundError(f"transfer_id: no export {request.transfer_id} on this worker")
        state_bytes = 0 if state_slot is None or cache.states is None else cache.states.slot_bytes()
        yield header(cache, len(block_ids), state_bytes)
        failpoints.crash("worker.read_blocks", str(request.transfer_id))
        # The copy out of the cache runs off the event loop (it may be large).
        data = await asyncio.to_thread(read_export, cache, block_ids, state_slot)
        start, sent = time.monotonic(), 0
        for chunk in data_chunks(data):
            yield chunk
            sent += len(chunk.data)
            if self.kv_send_rate:
                await asyncio.sleep(start + sent / self.kv_send_rate - time.monotonic())
        metrics.BLOCKS_EXPORTED.inc(len(block_ids))

    def _execute(
        self, board: MaskBoard, passes_end: PassesEnd, received: Received
    ) -> tuple[StepResult, tuple[int, int] | None]:
        """On the model thread: the step's result and its forward pass's (start, end), inside
        an `execute` span (the child of the scheduler's step span) when the step carries a
        traceparent; raises what a step that could not be read carries. Deferred masks come
        from `board`; the word to end multi-step runs early from `passes_end`."""
        step = received.step
        if isinstance(step, BaseException):
            raise step
        if not received.traceparent:
            return self._execute_step(step, board, passes_end)
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
            result, forward = self._execute_step(step, board, passes_end)
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
        self, step: StepInput, board: MaskBoard, passes_end: PassesEnd
    ) -> tuple[StepResult, tuple[int, int] | None]:
        step_id = step.step_id
        result = self.worker.execute(
            step, lambda: board.take(step_id), lambda: passes_end.ends(step_id)
        )
        metrics.observe_step(step.num_scheduled_tokens, result.forward_ns, result.sample_ns)
        metrics.observe_prepare(self.worker.last_prepare_ns)
        if step.deferred_mask_seq_ids:
            metrics.observe_mask_wait(result.mask_wait_ns)
        return result, self.worker.last_forward_ns
