"""The router: gateway streams in, replica outputs back to the right gateway.

`Router` owns the gateways' requests: it admits them, hands them to the `Fleet` (which places
them on replicas and moves them when a replica goes away), and turns the replicas' deltas into
messages for the right gateway. Request ids are scoped to the gateway stream that added them
(two gateways may reuse an id), so internally a request is known as "<stream id>/<request id>".

For each request whose choices stream, the router keeps what its gateway has been sent (tokens,
logprobs, finish state per choice): a request on a replica whose step failed continues from
exactly that, so its client sees no token twice and none missing. With a stream interval
above 1 (`FleetConfig.stream_interval`) a request's deltas wait in its route until enough
tokens have gathered; a resumed request drops what waited, since it continues from what was
sent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

from llmserve.errors import AlreadyExistsError, ApiError, DeadlineExceededError, FieldError
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.logs import get_logger
from llmserve.proto_convert import (
    grammar_from_proto,
    reasoning_from_proto,
    sampling_params_from_proto,
)
from llmserve.sampling_params import SamplingParams, with_admission_seed
from llmserve.v1 import scheduler_pb2
from scheduler_service.engine import metrics
from scheduler_service.engine.request_output import (
    RequestOutput,
    extend_delta,
    owned_delta,
)
from scheduler_service.engine.snapshots import (
    GroupSnapshot,
    SequenceSnapshot,
    snapshot_from_choices,
)
from scheduler_service.engine.text_stops import StopStrings
from scheduler_service.fleet.admission import SchedulerAdmission, arm_deadline
from scheduler_service.fleet.fleet import Fleet
from scheduler_service.fleet.fleet_config import FleetConfig
from scheduler_service.fleet.messages import (
    OutboxBatches,
    continued_choices,
    error_message,
    fill_output,
    record_sent,
)
from scheduler_service.fleet.tracing import end_request_trace, start_request_trace, trace_id_of

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
    # Deltas not yet sent, as one (`_due`; only with a stream interval above 1).
    held: RequestOutput | None = None
    step_failures: int = 0
    # From the gateway's traceparent, for log lines (None when the request is not traced).
    trace_id: str | None = None
    priority: int = 0
    stop_strings: StopStrings | None = None
    grammar: GrammarSpec | None = None
    reasoning: ReasoningSpec | None = None


def _due(route: _Route, output: RequestOutput, interval: int) -> RequestOutput | None:
    """`output` behind what `route` held, if it is to go now: the request's first tokens, its
    end, an error, prompt logprobs, or once a choice has gathered `interval` tokens. Otherwise
    it is held (None)."""
    held = route.held
    if held is not None:
        extend_delta(held, output)
        output = held
    if (
        output.finished
        or output.error is not None
        or output.prompt_logprobs
        or route.num_output_tokens == 0
        or max((len(c.token_ids) for c in output.outputs), default=0) >= interval
    ):
        route.held = None
        return output
    if held is None:
        route.held = owned_delta(output)
    return None


class Router:
    """Admits gateway requests, hands them to the fleet, routes their outputs back."""

    def __init__(
        self,
        config: FleetConfig,
        on_ready_change=lambda ready: None,  # type: ignore[no-untyped-def]
        admission: SchedulerAdmission | None = None,
    ) -> None:
        self.fleet = Fleet(config, self, on_ready_change)
        self.admission = admission or SchedulerAdmission()
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
            stream.outbox.put_nowait(error_message(add.request_id, exc))

    def _add(self, stream: GatewayStream, add: scheduler_pb2.AddRequest) -> None:
        if not add.request_id:
            raise FieldError("request_id", "must not be empty")
        if add.request_id in stream.request_ids:
            raise AlreadyExistsError(
                f"request_id: {add.request_id!r} is already running", "request_id"
            )
        if not add.HasField("sampling_params"):
            raise FieldError("sampling_params", "required")
        self.admission.check(self.fleet, add.resubmitted)
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
            priority=add.priority,
            stop_strings=StopStrings(tuple(add.stop), not add.decode_special_tokens)
            if add.stop
            else None,
            grammar=grammar_from_proto(add.grammar) if add.HasField("grammar") else None,
            reasoning=reasoning_from_proto(add.reasoning) if add.HasField("reasoning") else None,
        )
        if add.HasField("continuation"):
            route.sent = continued_choices(add.continuation, params)
            route.num_output_tokens = sum(len(c.output_token_ids) for c in route.sent.values())
        snapshot = self._snapshot(key, route)
        trace = start_request_trace(
            key, add.traceparent, len(route.prompt_token_ids), self.fleet.config.shard
        )
        try:
            self.fleet.place(snapshot, trace)
        except ApiError:
            end_request_trace(trace, "refused")
            raise
        stream.request_ids.add(add.request_id)
        self.routes[key] = route
        if add.timeout_ms:
            arm_deadline(add.timeout_ms, key, route, self._expire)
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
            route.priority,
            route.stop_strings,
            route.grammar,
            route.reasoning,
        )

    def abort(self, stream: GatewayStream, request_id: str) -> None:
        key = stream.key(request_id)
        self.routes.pop(key, None)
        stream.request_ids.discard(request_id)
        self.fleet.abort(key)

    def _expire(self, key: str, route: object) -> None:
        """A request's deadline passed: free its blocks and tell its gateway."""
        if self.routes.get(key) is not route:
            return
        self.fleet.abort(key)
        self.fail_request(
            key, DeadlineExceededError("the request's deadline passed before it finished")
        )

    # -- FleetOwner ------------------------------------------------------------------------------

    def is_routed(self, key: str) -> bool:
        return key in self.routes

    def resume_snapshot(self, key: str) -> GroupSnapshot | None:
        route = self.routes.get(key)
        if route is None:
            return None
        route.held = None  # the request goes on from what was sent: these tokens come again
        return self._snapshot(key, route)

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
        route.stream.outbox.put_nowait(error_message(route.request_id, error))
        log.warning(
            "request failed",
            request_id=route.request_id,
            code=error.grpc_code.name,
            error=error.message,
        )

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        batches = OutboxBatches()
        interval = self.fleet.config.stream_interval
        try:
            for output in outputs:
                route = self.routes.get(output.request_id)
                if route is None:
                    continue  # aborted meanwhile
                if interval > 1:
                    due = _due(route, output, interval)
                    if due is None:
                        continue
                    output = due
                route.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                outbox = route.stream.outbox
                if output.error is not None:
                    batches.slot(outbox).CopyFrom(error_message(route.request_id, output.error))
                else:
                    if route.params.streams_choices:
                        record_sent(route.sent, output.outputs)
                    if output.prompt_logprobs:
                        message = scheduler_pb2.SchedulerMessage()
                        slot = message.output
                    else:
                        message, slot = None, batches.slot(outbox).output
                    fill_output(
                        slot,
                        route.request_id,
                        len(route.prompt_token_ids),
                        route.num_output_tokens,
                        output,
                    )
                    if message is not None:
                        batches.alone(outbox, message)
                if output.finished:
                    self._finish(output, route)
        finally:
            batches.flush()

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
                route.priority,
            )

    # -- stats ---------------------------------------------------------------------------------

    def stats(self, check_invariants: bool = False) -> scheduler_pb2.GetStatsResponse:
        reply = scheduler_pb2.GetStatsResponse(
            num_unfinished_requests=len(self.routes),
            num_gateways=len(self.streams),
            shard=self.fleet.config.shard,
        )
        for replica in self.fleet.replicas:
            counters = replica.counters()
            entry = reply.replicas.add(
                replica_id=replica.replica_id,
                address=replica.address,
                healthy=replica.healthy,
                num_steps=counters.num_steps,
                state=int(replica.state),
                num_migrated_out=counters.num_migrated_out,
                prefix_cache_queries=counters.prefix_cache_queries,
                prefix_cache_hits=counters.prefix_cache_hits,
                num_preemptions=counters.num_preemptions,
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
            entry.gpu_blocks_total = engine.cache_config.num_gpu_blocks - bm.num_reserved
            entry.cpu_blocks_free = bm.get_num_free_cpu_blocks()
            entry.cpu_blocks_total = engine.cache_config.num_cpu_blocks
            entry.max_model_len = engine.scheduler_config.model_len
            entry.num_transfers = len(bm.transfers.pins)
            for window, used in zip(bm.windows, bm.group_usage(), strict=True):
                entry.kv_groups.add(sliding_window=window, blocks_used=used)
            if bm.states is not None:
                entry.state_slots_free = bm.states.num_unheld()
                entry.state_slots_total = bm.states.num_slots
            if check_invariants:
                try:
                    bm.check_invariants()
                except AssertionError as exc:
                    entry.invariant_violation = str(exc) or "block accounting violated"
        lens = [r.max_model_len for r in reply.replicas if r.max_model_len]
        reply.max_model_len = min(lens, default=0)
        totals = self.fleet.totals()
        reply.totals.num_steps = totals.num_steps
        reply.totals.num_migrated_out = totals.num_migrated_out
        reply.totals.num_preemptions = totals.num_preemptions
        reply.totals.prefix_cache_queries = totals.prefix_cache_queries
        reply.totals.prefix_cache_hits = totals.prefix_cache_hits
        return reply
