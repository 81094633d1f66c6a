"""The scheduler's link to one worker: cache initialization, the Execute stream, health checks.

`open_worker` asks the worker what it serves (`Info`), initializes its KV cache with the
fleet's overrides and batch limits (`InitializeCache`), and derives the replica's scheduler
and cache configurations from the answers, from which each connection's engine is built
(`WorkerLink.new_engine`). `ExecuteStream` carries the steps. `watch_health` probes a
connected worker. `Replica` (replica.py) owns the link and runs the step loop over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.proto_convert import ROLE_NAMES
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from scheduler_service.engine.config import CacheConfig, ConfigError, SchedulerConfig
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.text_stops import tokenizer_loader
from scheduler_service.fleet.fleet_config import ReplicaConfig

# A worker that answers InitializeCache with one of these refuses its configuration (a cache
# too small for max_model_len, more than its memory holds): misconfigured, not unreachable.
REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class WorkerLostError(RuntimeError):
    """The worker cannot run this replica's steps any more. `cause` labels the migration."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


# How long a worker's Execute stream may stay open before it counts as another scheduler's,
# and how often it is asked meanwhile.
HELD_WAIT_S = 1.0
HELD_POLL_S = 0.1


def as_loss(
    exc: grpc.aio.AioRpcError | WorkerLostError | ConfigError,
) -> tuple[WorkerLostError, bool]:
    """What ended a replica's connection, as a `WorkerLostError`, and whether the worker
    refused its configuration (it answers, but not with the cache or length asked for: a
    misconfiguration, not an unreachable worker)."""
    refused = isinstance(exc, ConfigError) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() in REFUSALS
    )
    if isinstance(exc, ConfigError):
        return WorkerLostError("config", str(exc)), refused
    if isinstance(exc, grpc.aio.AioRpcError):
        return WorkerLostError("stream", exc.details() or exc.code().name), refused
    return exc, refused


class HeldElsewhereError(RuntimeError):
    """Another scheduler (a shard) drives the worker: its Execute stream is open there."""


class ExecuteStream:
    """The bidi Execute stream: one step out, one result back, in order (a step's deferred
    masks follow it as a message of their own, with no result, as does the word to end the
    multi-step runs in flight)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self._outbox: asyncio.Queue[worker_pb2.ExecuteRequest | None] = asyncio.Queue()
        self._call = stub.Execute(self._requests())

    async def _requests(self) -> AsyncIterator[worker_pb2.ExecuteRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def execute(
        self, request: worker_pb2.ExecuteRequest, timeout_s: float
    ) -> worker_pb2.ExecuteResult:
        """Send one step and wait for its result."""
        self.send(request)
        return await self.receive(timeout_s)

    def send(self, request: worker_pb2.ExecuteRequest) -> None:
        """Queue one step for the worker; its result comes back, in order, from `receive`.
        Asynchronous scheduling sends the next step before the previous result is read."""
        self._outbox.put_nowait(request)

    async def receive(self, timeout_s: float) -> worker_pb2.ExecuteResult:
        """The result of the oldest step sent and not yet received. Raises WorkerLostError
        when none comes within `timeout_s` (the watchdog) or the stream ends."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
            # lands as the read completes, and `Replica.stop` relies on cancelling this await.
            async with asyncio.timeout(timeout_s):
                result = await self._call.read()
        except TimeoutError:
            self.close()
            raise WorkerLostError(
                "watchdog", f"no step result within the {timeout_s:.1f} s watchdog"
            ) from None
        except grpc.aio.AioRpcError as exc:
            raise WorkerLostError("stream", exc.details() or exc.code().name) from exc
        if result is grpc.aio.EOF:
            raise WorkerLostError("stream", "the worker closed the Execute stream")
        return result

    @property
    def closed(self) -> bool:
        return self._call.done()

    def on_close(self, callback: Callable[[], None]) -> None:
        self._call.add_done_callback(lambda _call: callback())

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()


@dataclass(frozen=True, slots=True)
class WorkerLink:
    """What a connected worker serves, and the configurations of its replica."""

    info: worker_pb2.InfoResponse
    scheduler: SchedulerConfig
    cache: CacheConfig

    def new_engine(self) -> LLMEngine:
        """A fresh engine for these configurations (every connection starts with one), its
        grammar backend warming up."""
        engine = LLMEngine(
            self.scheduler, self.cache, UNUSED_EXECUTOR, tokenizer_loader(self.info.model)
        )
        engine.warm_grammars()
        return engine

    def log_fields(self) -> dict[str, object]:
        """What the replica's "ready" line says of the link."""
        return {
            "model": self.info.model,
            "role": ROLE_NAMES[self.info.role],
            "num_gpu_blocks": self.cache.num_gpu_blocks,
            "num_cpu_blocks": self.cache.num_cpu_blocks,
            "block_size": self.info.block_size,
            "max_model_len": self.scheduler.model_len,
        }


async def open_worker(stub: worker_pb2_grpc.WorkerStub, cfg: ReplicaConfig) -> WorkerLink:
    """Initialize the worker's cache. Raises grpc.aio.AioRpcError if it does not answer or
    refuses (`REFUSALS`), ConfigError if our --max-model-len is above the worker's, and
    HeldElsewhereError if another scheduler drives it."""
    info = await stub.Info(worker_pb2.InfoRequest(), timeout=10)
    waited = 0.0
    while info.execute_stream_open:
        # Our own previous stream (closed just now, after a failed step) may not have ended
        # on the worker yet; another scheduler's stays open.
        if waited >= HELD_WAIT_S:
            raise HeldElsewhereError("another scheduler's Execute stream is open on the worker")
        await asyncio.sleep(HELD_POLL_S)
        waited += HELD_POLL_S
        info = await stub.Info(worker_pb2.InfoRequest(), timeout=10)
    # max_model_len: the worker's model and cache decide it; ours may only lower it.
    scheduler_config = cfg.scheduler.with_worker_max_model_len(info.max_model_len)
    num_cpu = cfg.num_cpu_blocks_override
    if num_cpu is None:
        num_cpu = info.num_cpu_blocks_available
    # The batch limits are ours: the worker sizes its profile run and CUDA graphs by them.
    request = worker_pb2.InitializeCacheRequest(
        num_cpu_blocks=num_cpu,
        max_num_seqs=scheduler_config.max_num_seqs,
        max_num_batched_tokens=scheduler_config.token_budget,
    )
    # An override replaces the worker's count, larger or smaller (as in vLLM); without one
    # the worker allocates what fits beside the largest step under our limits.
    if cfg.num_gpu_blocks_override is not None:
        request.num_gpu_blocks = cfg.num_gpu_blocks_override
    try:
        reply = await stub.InitializeCache(request, timeout=120)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.ALREADY_EXISTS:  # a stream opened since Info
            raise HeldElsewhereError(exc.details() or "held") from exc
        raise
    cache_config = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=reply.num_gpu_blocks,
        num_cpu_blocks=reply.num_cpu_blocks,
        watermark=cfg.watermark,
        enable_prefix_caching=cfg.enable_prefix_caching,
        kv_windows=kv_windows(info),
        num_state_slots=reply.num_state_slots,
    )
    return WorkerLink(info, scheduler_config, cache_config)


def kv_windows(info: worker_pb2.InfoResponse) -> tuple[int | None, ...]:
    """The sliding window of each of the worker's KV groups (a worker that reports none has
    one full group)."""
    windows = tuple(
        g.sliding_window if g.HasField("sliding_window") else None for g in info.kv_groups
    )
    return windows or (None,)


async def watch_health(
    health: health_pb2_grpc.HealthStub,
    cfg: ReplicaConfig,
    connected: Callable[[], bool],
    on_serving: Callable[[], None],
    on_lost: Callable[[str, str], None],
    on_not_serving: Callable[[], None],
) -> None:
    """While `connected()`, check the worker's health every `health_interval_s`: SERVING
    calls `on_serving`; `health_failures` failed checks in a row call `on_lost` (hung, or gone
    without closing its stream); another answer calls `on_not_serving` (a worker told to
    stop)."""
    failures = 0
    serving = health_pb2.HealthCheckResponse.SERVING
    while True:
        await asyncio.sleep(cfg.health_interval_s)
        if not connected():
            failures = 0
            continue
        try:
            reply = await health.Check(
                health_pb2.HealthCheckRequest(), timeout=cfg.health_interval_s
            )
        except grpc.aio.AioRpcError as exc:
            failures += 1
            if failures >= cfg.health_failures:
                on_lost("health", f"{failures} failed health checks: {exc.code().name}")
                failures = 0
            continue
        failures = 0
        if reply.status == serving:
            on_serving()
        else:
            on_not_serving()


class StepWatchdog:
    """How long a step may take before its worker counts as lost: `step_watchdog_s` if set,
    else the larger of `watchdog_floor_s` and `watchdog_factor` times the slowest step seen."""

    def __init__(self, cfg: ReplicaConfig) -> None:
        self._cfg = cfg
        self._slowest_s = 0.0

    def observe(self, seconds: float) -> None:
        self._slowest_s = max(self._slowest_s, seconds)

    def timeout_s(self) -> float:
        cfg = self._cfg
        if cfg.step_watchdog_s is not None:
            return cfg.step_watchdog_s
        return max(cfg.watchdog_floor_s, cfg.watchdog_factor * self._slowest_s)


class _UnusedExecutor:
    """The service drives steps itself (begin_step / finish_step), never `LLMEngine.step`."""

    def execute(self, step):  # type: ignore[no-untyped-def]
        raise AssertionError("the scheduler service executes steps over gRPC")


UNUSED_EXECUTOR = _UnusedExecutor()
