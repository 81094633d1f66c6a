"""The Scheduler gRPC service: gateway streams in, the worker fleet out.

`Router` owns the gateways' requests: it admits them, hands them to the `Fleet` (which places
them on replicas and moves them when a replica goes away), and turns the replicas' deltas into
messages for the right gateway. Request ids are scoped to the gateway stream that added them
(two gateways may reuse an id), so internally a request is known as "<stream id>/<request id>".

For each request whose choices stream, the router keeps what its gateway has been sent (tokens,
logprobs, finish state per choice): a request on a replica whose step failed continues from
exactly that, so its client sees no token twice and none missing.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from llmserve.continuation import continuation_from_proto
from llmserve.errors import (
    AlreadyExistsError,
    ApiError,
    FieldError,
    grpc_status,
)
from llmserve.logs import get_logger
from llmserve.proto_convert import (
    finish_reason_to_proto,
    sampling_params_from_proto,
    token_logprob_to_proto,
)
from llmserve.sampling_params import SamplingParams, with_admission_seed
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_service import metrics
from scheduler_service.fleet import Fleet, FleetConfig
from scheduler_service.migration import GroupSnapshot, SequenceSnapshot, snapshot_from_choices
from scheduler_service.outputs import CompletionOutput, RequestOutput
from scheduler_service.sequence import FinishReason, RequestMetrics, SampleLogprobs
from scheduler_service.tracing import end_request_trace, start_request_trace, trace_id_of

log = get_logger(__name__)


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
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    num_output_tokens: int = 0
    # What the gateway was sent, per choice index (streaming requests only).
    sent: dict[int, SequenceSnapshot] = field(default_factory=dict)
    step_failures: int = 0
    # From the gateway's traceparent, for log lines (None when the request is not traced).
    trace_id: str | None = None


class Router:
    """Admits gateway requests, hands them to the fleet, routes their outputs back."""

    def __init__(self, config: FleetConfig, on_ready_change=lambda ready: None) -> None:  # type: ignore[no-untyped-def]
        self.fleet = Fleet(config, self, on_ready_change)
        self.routes: dict[str, _Route] = {}
        self.streams: set[GatewayStream] = set()
        self._stream_ids = itertools.count()
        self._seeds = random.Random()

    def start(self, static_workers: list[str]) -> None:
        self.fleet.start(static_workers)

    async def stop(self) -> None:
        await self.fleet.stop()

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
        except ApiError as exc:
            stream.outbox.put_nowait(_error_message(add.request_id, exc))

    def _add(self, stream: GatewayStream, add: scheduler_pb2.AddRequest) -> None:
        if not add.request_id:
            raise FieldError("request_id", "must not be empty")
        if add.request_id in stream.request_ids:
            raise AlreadyExistsError(
                f"request_id: {add.request_id!r} is already running", "request_id"
            )
        if not add.HasField("sampling_params"):
            raise FieldError("sampling_params", "required")
        params = with_admission_seed(sampling_params_from_proto(add.sampling_params), self._seeds)
        key = stream.key(add.request_id)
        route = _Route(
            stream,
            add.request_id,
            list(add.prompt_token_ids),
            params,
            add.eos_token_id if add.HasField("eos_token_id") else None,
            time.monotonic(),
            trace_id=trace_id_of(add.traceparent),
        )
        if add.HasField("continuation"):
            route.sent = _continued_choices(add.continuation, params)
            route.num_output_tokens = sum(len(c.output_token_ids) for c in route.sent.values())
        snapshot = self._snapshot(key, route)
        trace = start_request_trace(key, add.traceparent, len(route.prompt_token_ids))
        try:
            self.fleet.place(snapshot, trace)
        except ApiError:
            end_request_trace(trace, "refused")
            raise
        stream.request_ids.add(add.request_id)
        self.routes[key] = route
        log.info(
            "request queued",
            request_id=add.request_id,
            trace_id=route.trace_id,
            prompt_tokens=len(route.prompt_token_ids),
            continued_tokens=route.num_output_tokens,
        )

    def _snapshot(self, key: str, route: _Route) -> GroupSnapshot:
        return snapshot_from_choices(
            key,
            route.prompt_token_ids,
            route.params,
            route.eos_token_id,
            route.arrival_time,
            list(route.sent.values()),
        )

    def abort(self, stream: GatewayStream, request_id: str) -> None:
        key = stream.key(request_id)
        self.routes.pop(key, None)
        stream.request_ids.discard(request_id)
        self.fleet.abort(key)

    # -- FleetOwner ------------------------------------------------------------------------------

    def is_routed(self, key: str) -> bool:
        return key in self.routes

    def resume_snapshot(self, key: str) -> GroupSnapshot | None:
        route = self.routes.get(key)
        return None if route is None else self._snapshot(key, route)

    def count_step_failure(self, key: str) -> int:
        route = self.routes.get(key)
        if route is None:
            return 0
        route.step_failures += 1
        return route.step_failures

    def fail_request(self, key: str, error: ApiError) -> None:
        route = self.routes.pop(key, None)
        if route is None:
            return
        route.stream.request_ids.discard(route.request_id)
        self.fleet.finished(key)
        route.stream.outbox.put_nowait(_error_message(route.request_id, error))
        log.warning(
            "request failed",
            request_id=route.request_id,
            code=error.grpc_code.name,
            error=error.message,
        )

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self.routes.get(output.request_id)
            if route is None:
                continue  # aborted meanwhile
            route.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
            if output.ignore_reason is not None:
                message = _error_message(
                    route.request_id, FieldError("prompt", output.ignore_reason)
                )
            else:
                if route.params.streams_choices:
                    _record_sent(route.sent, output.outputs)
                message = scheduler_pb2.SchedulerMessage(output=_output_to_proto(route, output))
            route.stream.outbox.put_nowait(message)
            if output.finished:
                self._finish(output, route)

    def _finish(self, output: RequestOutput, route: _Route) -> None:
        del self.routes[output.request_id]
        self.fleet.finished(output.request_id)
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

    # -- stats ---------------------------------------------------------------------------------

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        reply = scheduler_pb2.GetStatsResponse(
            num_unfinished_requests=len(self.routes), num_gateways=len(self.streams)
        )
        for replica in self.fleet.replicas:
            entry = reply.replicas.add(
                replica_id=replica.replica_id,
                address=replica.address,
                healthy=replica.healthy,
                num_steps=replica.num_steps,
                state=int(replica.state),
                num_migrated_out=replica.num_migrated_out,
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
            entry.max_model_len = engine.scheduler_config.model_len
        lens = [r.max_model_len for r in reply.replicas if r.max_model_len]
        reply.max_model_len = min(lens, default=0)
        return reply


def _record_sent(sent: dict[int, SequenceSnapshot], choices: list[CompletionOutput]) -> None:
    """Add a streamed delta to what the gateway has been sent."""
    for choice in choices:
        record = sent.get(choice.index)
        if record is None:
            record = sent[choice.index] = SequenceSnapshot(choice.index, [], [], 0.0, None, None)
        record.output_token_ids.extend(choice.token_ids)
        if choice.logprobs is not None:
            record.output_logprobs.extend(choice.logprobs)
        record.cumulative_logprob = choice.cumulative_logprob
        record.finish_reason = choice.finish_reason
        record.stop_token_id = choice.stop_token_id


def _continued_choices(
    continuation: scheduler_pb2.Continuation, params: SamplingParams
) -> dict[int, SequenceSnapshot]:
    """The gateway's record of a request re-submitted after a scheduler restart."""
    choices = continuation_from_proto(continuation, params)
    return {
        c.index: SequenceSnapshot(
            c.index,
            c.token_ids,
            [SampleLogprobs(token, top) for token, top in c.logprobs],
            c.cumulative_logprob,
            None if c.finish_reason is None else FinishReason(c.finish_reason),
            c.stop_token_id,
        )
        for c in choices
    }


def _error_message(request_id: str, exc: ApiError) -> scheduler_pb2.SchedulerMessage:
    code, message = grpc_status(exc)
    return scheduler_pb2.SchedulerMessage(
        error=scheduler_pb2.RequestError(
            request_id=request_id, code=code.value[0], message=message, field=exc.field or ""
        )
    )


def _choice_to_proto(choice: CompletionOutput) -> scheduler_pb2.ChoiceDelta:
    msg = scheduler_pb2.ChoiceDelta(
        index=choice.index,
        token_ids=choice.token_ids,
        cumulative_logprob=choice.cumulative_logprob,
    )
    if choice.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(choice.finish_reason)
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
        msg.usage.prompt_tokens = len(route.prompt_token_ids)
        msg.usage.completion_tokens = route.num_output_tokens
        if output.metrics is not None:
            msg.metrics.CopyFrom(_metrics_to_proto(output.metrics))
    return msg


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FieldError("address", f"must be host:port, got {address!r}")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Thin: every RPC is one call into the Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        _check_address(request.address)
        replica = self.router.fleet.register(request.address)
        return scheduler_pb2.RegisterWorkerResponse(
            replica_id=replica.replica_id,
            lease_ms=int(self.router.fleet.config.lease_s * 1000),
        )

    async def DrainWorker(
        self, request: scheduler_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DrainWorkerResponse:
        _check_address(request.address)
        replica, num_requests = self.router.fleet.drain(request.address)
        log.info("drain requested", address=request.address, requests=num_requests)
        return scheduler_pb2.DrainWorkerResponse(
            replica_id=replica.replica_id, num_requests=num_requests
        )

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
