"""The Scheduler gRPC service: gateway streams in, worker replicas out.

`Router` owns the mapping between gateways' requests and replicas. Request ids are scoped to
the gateway stream that added them (two gateways may reuse an id), so internally a request
is known as "<stream id>/<request id>".
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from llmserve.grpc_utils import RequestError
from llmserve.logs import get_logger
from llmserve.proto_convert import sampling_params_from_proto, token_logprob_to_proto
from llmserve.sampling_params import SamplingParamsError
from llmserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_service import metrics
from scheduler_service.engine import RequestError as EngineRequestError
from scheduler_service.outputs import CompletionOutput, RequestOutput
from scheduler_service.replica import Replica, ReplicaConfig, WorkerUnavailableError
from scheduler_service.sequence import FinishReason, RequestMetrics
from scheduler_service.tracing import trace_id_of

log = get_logger(__name__)

_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.IGNORED: common_pb2.FINISH_REASON_IGNORED,
}


@dataclass(eq=False)
class GatewayStream:
    """One gateway's Connect stream."""

    stream_id: int
    peer: str
    outbox: asyncio.Queue[scheduler_pb2.SchedulerMessage | None] = field(
        default_factory=asyncio.Queue
    )
    request_ids: set[str] = field(default_factory=set)

    def key(self, request_id: str) -> str:
        return f"{self.stream_id}/{request_id}"


@dataclass(eq=False)
class _Route:
    stream: GatewayStream
    request_id: str
    replica: Replica
    num_prompt_tokens: int
    num_output_tokens: int = 0
    # From the gateway's traceparent, for log lines (None when the request is not traced).
    trace_id: str | None = None


class Router:
    """Places requests on replicas and routes their outputs back to the right gateway."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.replicas: dict[int, Replica] = {}
        self.routes: dict[str, _Route] = {}
        self.streams: set[GatewayStream] = set()
        self._replica_ids = itertools.count()
        self._stream_ids = itertools.count()

    # -- replicas ----------------------------------------------------------------------------

    def add_replica(self, address: str) -> Replica:
        for replica in self.replicas.values():
            if replica.address == address:
                return replica
        replica_id = next(self._replica_ids)
        replica = Replica(replica_id, address, self.config, self._on_outputs, self._on_failure)
        self.replicas[replica_id] = replica
        replica.start()
        log.info("replica added", replica=replica_id, address=address)
        return replica

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas.values()))

    def _pick_replica(self) -> Replica:
        healthy = [r for r in self.replicas.values() if r.healthy]
        if not healthy:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "no worker is connected yet; the scheduler keeps retrying its workers",
            )
        return min(healthy, key=lambda r: r.num_unfinished())

    # -- gateway streams ---------------------------------------------------------------------

    def open_stream(self, peer: str) -> GatewayStream:
        stream = GatewayStream(next(self._stream_ids), peer)
        self.streams.add(stream)
        return stream

    def close_stream(self, stream: GatewayStream) -> None:
        for request_id in list(stream.request_ids):
            self.abort(stream, request_id)
        self.streams.discard(stream)

    def add(self, stream: GatewayStream, add: scheduler_pb2.AddRequest) -> None:
        """Queue a request, or answer it at once with a RequestError."""
        try:
            self._add(stream, add)
        except (
            RequestError,
            SamplingParamsError,
            EngineRequestError,
            WorkerUnavailableError,
        ) as exc:
            stream.outbox.put_nowait(_error_message(add.request_id, exc))

    def _add(self, stream: GatewayStream, add: scheduler_pb2.AddRequest) -> None:
        if not add.request_id:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty", "request_id"
            )
        if add.request_id in stream.request_ids:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id: {add.request_id!r} is already running",
                "request_id",
            )
        if not add.HasField("sampling_params"):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "sampling_params: required", "sampling_params"
            )
        params = sampling_params_from_proto(add.sampling_params)
        replica = self._pick_replica()
        key = stream.key(add.request_id)
        prompt = list(add.prompt_token_ids)
        eos = add.eos_token_id if add.HasField("eos_token_id") else None
        replica.add_request(key, prompt, params, eos, time.monotonic(), add.traceparent)
        stream.request_ids.add(add.request_id)
        route = _Route(
            stream, add.request_id, replica, len(prompt), 0, trace_id_of(add.traceparent)
        )
        self.routes[key] = route
        log.info(
            "request queued",
            request_id=add.request_id,
            trace_id=route.trace_id,
            replica=replica.replica_id,
            prompt_tokens=len(prompt),
        )

    def abort(self, stream: GatewayStream, request_id: str) -> None:
        route = self.routes.pop(stream.key(request_id), None)
        stream.request_ids.discard(request_id)
        if route is not None:
            route.replica.abort_request(stream.key(request_id))

    # -- replica callbacks ---------------------------------------------------------------------

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self.routes.get(output.request_id)
            if route is None:
                continue  # aborted meanwhile
            route.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
            if output.ignore_reason is not None:
                message = _error_message(
                    route.request_id,
                    RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"prompt: {output.ignore_reason}",
                        "prompt",
                    ),
                )
            else:
                message = scheduler_pb2.SchedulerMessage(output=_output_to_proto(route, output))
            route.stream.outbox.put_nowait(message)
            if output.finished:
                self._finish(output, route)

    def _finish(self, output: RequestOutput, route: _Route) -> None:
        del self.routes[output.request_id]
        route.stream.request_ids.discard(route.request_id)
        reasons = {str(c.finish_reason) for c in output.outputs if c.finish_reason}
        log.info(
            "request finished",
            request_id=route.request_id,
            trace_id=route.trace_id,
            finish_reasons=sorted(reasons),
            output_tokens=route.num_output_tokens,
        )
        m = output.metrics
        if m is not None and m.finished_time is not None:
            metrics.record_finished(
                ",".join(sorted(reasons)) or "unknown",
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.finished_time,
                route.num_output_tokens,
            )

    def _on_failure(self, keys: list[str], reason: str) -> None:
        for key in keys:
            route = self.routes.pop(key, None)
            if route is None:
                continue
            route.stream.request_ids.discard(route.request_id)
            route.stream.outbox.put_nowait(
                _error_message(route.request_id, RequestError(grpc.StatusCode.UNAVAILABLE, reason))
            )

    # -- stats ---------------------------------------------------------------------------------

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        reply = scheduler_pb2.GetStatsResponse(
            num_unfinished_requests=len(self.routes), num_gateways=len(self.streams)
        )
        for replica in self.replicas.values():
            entry = reply.replicas.add(
                replica_id=replica.replica_id,
                address=replica.address,
                healthy=replica.healthy,
                num_steps=replica.num_steps,
            )
            engine = replica.engine
            if engine is None:
                continue
            s = engine.get_stats()
            bm = engine.scheduler.block_manager
            entry.num_waiting, entry.num_running, entry.num_swapped = (
                s.num_waiting,
                s.num_running,
                s.num_swapped,
            )
            entry.gpu_blocks_free = bm.get_num_free_gpu_blocks()
            entry.gpu_blocks_total = engine.cache_config.num_gpu_blocks
            entry.cpu_blocks_free = bm.get_num_free_cpu_blocks()
            entry.cpu_blocks_total = engine.cache_config.num_cpu_blocks
            entry.prefix_cache_queries = s.prefix_cache_queries
            entry.prefix_cache_hits = s.prefix_cache_hits
            entry.num_preemptions = s.num_preemptions_recompute + s.num_preemptions_swap
        return reply


def _error_message(request_id: str, exc: Exception) -> scheduler_pb2.SchedulerMessage:
    if isinstance(exc, RequestError):
        code, field_name = exc.code, exc.field or ""
    elif isinstance(exc, WorkerUnavailableError):
        code, field_name = grpc.StatusCode.UNAVAILABLE, ""
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT
        field_name = getattr(exc, "field", "")
        if isinstance(exc, SamplingParamsError):
            field_name = f"sampling_params.{exc.field}"
    return scheduler_pb2.SchedulerMessage(
        error=scheduler_pb2.RequestError(
            request_id=request_id, code=code.value[0], message=str(exc), field=field_name
        )
    )


def _choice_to_proto(choice: CompletionOutput) -> scheduler_pb2.ChoiceDelta:
    msg = scheduler_pb2.ChoiceDelta(
        index=choice.index,
        token_ids=choice.token_ids,
        cumulative_logprob=choice.cumulative_logprob,
    )
    if choice.finish_reason is not None:
        msg.finish_reason = _FINISH_REASONS[choice.finish_reason]
    if choice.stop_token_id is not None:
        msg.stop_token_id = choice.stop_token_id
    for lp in choice.logprobs or ():
        msg.logprobs.add(
            token=token_logprob_to_proto(lp.token),
            top=[token_logprob_to_proto(t) for t in lp.top],
        )
    return msg


def _metrics_to_proto(m: RequestMetrics) -> scheduler_pb2.RequestMetrics:
    def ns(t: float | None) -> int:
        return 0 if t is None else max(int((t - m.arrival_time) * 1e9), 0)

    return scheduler_pb2.RequestMetrics(
        queue_ns=ns(m.first_scheduled_time),
        first_token_ns=ns(m.first_token_time),
        e2e_ns=ns(m.finished_time),
    )


def _output_to_proto(route: _Route, output: RequestOutput) -> scheduler_pb2.RequestOutput:
    msg = scheduler_pb2.RequestOutput(
        request_id=route.request_id,
        choices=[_choice_to_proto(c) for c in output.outputs],
        finished=output.finished,
    )
    for p in output.prompt_logprobs or ():
        msg.prompt_logprobs.add(
            position=p.position,
            token=token_logprob_to_proto(p.token),
            top=[token_logprob_to_proto(t) for t in p.top],
        )
    if output.finished:
        msg.usage.prompt_tokens = route.num_prompt_tokens
        msg.usage.completion_tokens = route.num_output_tokens
        if output.metrics is not None:
            msg.metrics.CopyFrom(_metrics_to_proto(output.metrics))
    return msg


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Thin: every RPC is one call into the Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        if not request.address or ":" not in request.address:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "address: must be host:port", "address"
            )
        replica = self.router.add_replica(request.address)
        return scheduler_pb2.RegisterWorkerResponse(replica_id=replica.replica_id)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        return self.router.stats()

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.GatewayMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        stream = self.router.open_stream(context.peer())
        log.info("gateway connected", stream=stream.stream_id, peer=stream.peer)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while (message := await stream.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self.router.close_stream(stream)
            log.info("gateway disconnected", stream=stream.stream_id)

    async def _read(
        self, request_iterator: AsyncIterator[scheduler_pb2.GatewayMessage], stream: GatewayStream
    ) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "add":
                    self.router.add(stream, message.add)
                elif kind == "abort":
                    self.router.abort(stream, message.abort.request_id)
        finally:
            stream.outbox.put_nowait(None)
