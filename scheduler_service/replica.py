"""One worker replica as the scheduler service sees it: its engine and its Execute stream.

The replica's loop runs on the event loop: schedule (a millisecond or two), send the step,
await the result, process outputs, hand the deltas to the router. It sleeps while idle and
wakes when a request arrives. If the worker goes away, every request on the replica fails
with UNAVAILABLE and the replica reconnects (the worker drops its sequence state; a new engine
starts empty, so nothing stale is resent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import grpc

from llmserve.grpc_utils import channel_options
from llmserve.logs import get_logger
from llmserve.proto_convert import step_input_to_proto, step_result_from_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from scheduler_service import metrics
from scheduler_service.config import CacheConfig, SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.outputs import RequestOutput
from scheduler_service.tracing import ReplicaTracer, end_step_span, step_traceparent

log = get_logger(__name__)

_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0)
_IDLE_STEPS_BEFORE_SLEEP = 3


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """What the scheduler service decides for every replica (the worker decides the rest)."""

    scheduler: SchedulerConfig
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_cpu_blocks_override: int | None = None
    max_message_bytes: int = 64 * 1024 * 1024


class WorkerUnavailableError(RuntimeError):
    """The worker's stream broke; requests on this replica cannot finish."""


class _ExecuteStream:
    """The bidi Execute stream: one request message out, one result back, in order."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self._outbox: asyncio.Queue[worker_pb2.ExecuteRequest | None] = asyncio.Queue()
        self._call = stub.Execute(self._requests())

    async def _requests(self) -> AsyncIterator[worker_pb2.ExecuteRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def execute(self, request: worker_pb2.ExecuteRequest) -> worker_pb2.ExecuteResult:
        self._outbox.put_nowait(request)
        try:
            result = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(exc.details() or exc.code().name) from exc
        if result is grpc.aio.EOF:
            raise WorkerUnavailableError("the worker closed the Execute stream")
        return result

    @property
    def closed(self) -> bool:
        return self._call.done()

    def on_close(self, callback: Callable[[], None]) -> None:
        self._call.add_done_callback(lambda _call: callback())

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()


class Replica:
    """A worker replica: engine + stream + loop. `on_outputs` receives every step's deltas;
    `on_failure` receives the request ids lost when the worker fails."""

    def __init__(
        self,
        replica_id: int,
        address: str,
        config: ReplicaConfig,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[list[str], str], None],
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.config = config
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._channel = grpc.aio.insecure_channel(
            address, options=channel_options(config.max_message_bytes)
        )
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.engine: LLMEngine | None = None
        self.tracer: ReplicaTracer | None = None
        self.info: worker_pb2.InfoResponse | None = None
        self._stream: _ExecuteStream | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self._stream is not None

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return self.engine.scheduler_config.max_model_len

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"replica-{self.replica_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._stream is not None:
            self._stream.close()
        await self._channel.close()

    # -- requests (called from gateway handlers, on the same event loop) ---------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        traceparent: str = "",
    ) -> None:
        if self.engine is None or self.tracer is None:
            raise WorkerUnavailableError(f"worker {self.address} is not connected")
        self.engine.add_request(request_id, prompt_token_ids, params, arrival_time, eos_token_id)
        self.tracer.add(request_id, traceparent, len(prompt_token_ids))
        self._wake.set()

    def abort_request(self, request_id: str) -> None:
        if self.engine is not None and self.engine.abort_request(request_id):
            if self.tracer is not None:
                self.tracer.abort(request_id)
            # Aborts free blocks now; the worker hears of it in the next step.
            self._wake.set()

    def num_unfinished(self) -> int:
        return 0 if self.engine is None else self.engine.get_num_unfinished_requests()

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._connect()
                attempt = 0
                await self._step_loop()
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, WorkerUnavailableError) as exc:
                reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self._fail_requests(f"worker {self.address} unavailable: {reason}")
                delay = _RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)]
                attempt += 1
                log.warning(
                    "worker not reachable, retrying",
                    replica=self.replica_id,
                    address=self.address,
                    reason=reason,
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)

    async def _connect(self) -> None:
        info = await self._stub.Info(worker_pb2.InfoRequest(), timeout=10)
        cfg = self.config
        num_gpu = info.num_gpu_blocks_available
        if cfg.num_gpu_blocks_override is not None:
            num_gpu = min(num_gpu, cfg.num_gpu_blocks_override)
        num_cpu = info.num_cpu_blocks_available
        if cfg.num_cpu_blocks_override is not None:
            num_cpu = min(num_cpu, cfg.num_cpu_blocks_override)
        reply = await self._stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu),
            timeout=120,
        )
        scheduler_config = replace(
            cfg.scheduler, max_model_len=min(cfg.scheduler.max_model_len, info.max_model_len)
        )
        cache_config = CacheConfig(
            block_size=info.block_size,
            num_gpu_blocks=reply.num_gpu_blocks,
            num_cpu_blocks=reply.num_cpu_blocks,
            watermark=cfg.watermark,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.info = info
        self._stream = _ExecuteStream(self._stub)
        # An idle loop sleeps on _wake: a stream that ends meanwhile wakes it to reconnect,
        # rather than failing the next request that arrives.
        self._stream.on_close(self._wake.set)
        self.engine = LLMEngine(scheduler_config, cache_config, _unused_executor)
        self.tracer = ReplicaTracer(self.replica_id, info.block_size)
        log.info(
            "replica ready",
            replica=self.replica_id,
            address=self.address,
            model=info.model,
            num_gpu_blocks=reply.num_gpu_blocks,
            num_cpu_blocks=reply.num_cpu_blocks,
            block_size=info.block_size,
            max_model_len=scheduler_config.max_model_len,
        )

    async def _step_loop(self) -> None:
        assert self.engine is not None and self._stream is not None and self.tracer is not None
        engine, stream, tracer = self.engine, self._stream, self.tracer
        block_manager = engine.scheduler.block_manager
        idle_steps = 0
        while True:
            if not engine.has_unfinished_requests():
                self._wake.clear()
                metrics.record_stats(self.replica_id, engine.get_stats())
                await self._wake.wait()
            if stream.closed:
                raise WorkerUnavailableError("the worker closed the Execute stream")
            started = time.perf_counter()
            started_ns = time.time_ns()
            free_before = block_manager.get_num_free_gpu_blocks()
            sched_out, step_input = engine.begin_step()
            step_span = tracer.step_span(engine, sched_out, step_input, started_ns, free_before)
            if step_input.is_empty():
                result = None
            else:
                request = step_input_to_proto(step_input)
                request.traceparent = step_traceparent(step_span)
                try:
                    reply = await stream.execute(request)
                except BaseException as exc:
                    end_step_span(step_span, 0, 0, exc)
                    raise
                result = step_result_from_proto(reply)
            outputs = engine.finish_step(sched_out, step_input, result)
            tracer.on_outputs(outputs)
            end_step_span(step_span, *((result.forward_ns, result.sample_ns) if result else (0, 0)))
            self.num_steps += 1
            metrics.record_step(
                self.replica_id,
                engine.get_stats(),
                step_input,
                result,
                time.perf_counter() - started,
            )
            if outputs:
                self._on_outputs(outputs)
            if step_input.is_empty() and not outputs:
                # An empty step can be followed by a productive one (frees held back a step,
                # blocks released by the previous step), so only several empty steps in a row
                # mean that nothing can run until a request arrives or is aborted.
                idle_steps += 1
                if idle_steps >= _IDLE_STEPS_BEFORE_SLEEP:
                    self._wake.clear()
                    await self._wake.wait()
                else:
                    await asyncio.sleep(0)
            else:
                idle_steps = 0

    def _fail_requests(self, reason: str) -> None:
        lost: list[str] = []
        if self.engine is not None:
            lost = self.engine.unfinished_request_ids()
        if self.tracer is not None:
            self.tracer.fail(lost, reason)
        self.engine = None
        self.tracer = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if lost:
            self._on_failure(lost, reason)


class _UnusedExecutor:
    """The service drives steps itself (begin_step / finish_step), never `LLMEngine.step`."""

    def execute(self, step):  # type: ignore[no-untyped-def]
        raise AssertionError("the scheduler service executes steps over gRPC")


_unused_executor = _UnusedExecutor()
