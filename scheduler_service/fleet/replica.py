"""One worker replica as the scheduler service sees it: its engine, its Execute stream, its life.

The replica's loop runs on the event loop: schedule (a millisecond or two), send the step,
await the result, process outputs, report the deltas. With asynchronous scheduling the next
step is sent before the result is awaited, where it can be (`replica_steps.StepPipeline`). It
sleeps while idle and wakes when a request arrives. It never calls the fleet that owns it: it
reports events (`replica_events`) through the `report` callable it was given.

A replica never takes its requests down with it. Whatever ends its loop hands the requests it
holds to the fleet (an `Evicted` event), which places them on other replicas, where they continue
by recompute with every token generated so far (a drain moves running requests with their KV
blocks instead, `kv_mover`):
- the worker is lost: its Execute stream breaks, a step outlives the watchdog, or the fleet
  marks it lost (failed health checks, lapsed lease). The engine's state is consistent (steps
  in flight never ran as far as the scheduler is concerned), so it is exported as it is;
- a step raises (a bug, an injected fault): the engine may be half-updated, so the router's
  record of what each client received is what continues (`cause="step_failed"`);
- the replica drains: see `Replica.drain`.
After a loss the replica reconnects with backoff (`reconnect`).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2_grpc

from llmserve.logs import get_logger
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from scheduler_service.engine import metrics
from scheduler_service.engine.config import ConfigError
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet import replica_events as events
from scheduler_service.fleet.compile_waits import wait_for_compiles
from scheduler_service.fleet.fleet_config import ReplicaConfig
from scheduler_service.fleet.reconnect import Reconnect, worker_channel
from scheduler_service.fleet.replica_events import ReplicaCounters, ReplicaState, Report
from scheduler_service.fleet.replica_steps import StepPipeline
from scheduler_service.fleet.tracing import ReplicaTracer, RequestTrace
from scheduler_service.fleet.transfer_queue import TransferQueue
from scheduler_service.fleet.worker_link import (
    ExecuteStream,
    HeldElsewhereError,
    StepWatchdog,
    WorkerLostError,
    as_loss,
    open_worker,
    watch_health,
)

__all__ = ["Replica", "ReplicaConfig", "ReplicaState", "WorkerLostError"]

log = get_logger(__name__)

_IDLE_STEPS_BEFORE_SLEEP = 3


class Replica:
    """A worker replica: engine + stream + loop, reporting its events through `report`."""

    def __init__(
        self, replica_id: int, address: str, config: ReplicaConfig, report: Report[Replica]
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.config = config
        self.report = report
        self._channel = worker_channel(address, config.max_message_bytes)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.engine: LLMEngine | None = None
        self.tracer: ReplicaTracer | None = None
        # KV transfer maps for the next step (scheduler_service.fleet.kv_mover); one per engine.
        self.transfers: TransferQueue | None = None
        self.info: worker_pb2.InfoResponse | None = None
        self.state = ReplicaState.JOINING
        self._stream: ExecuteStream | None = None
        self._steps: StepPipeline | None = None  # while the step loop runs
        self._wake = asyncio.Event()
        self._reconnect = Reconnect()
        self._task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._lost: WorkerLostError | None = None
        self._stopping = False  # `stop` was called: the loop must not connect again
        self.drain_started: float | None = None
        # Request ids of the steps in flight (between begin_step and finish_step; two steps
        # with asynchronous scheduling).
        self._in_step: list[str] = []
        self.num_steps = 0
        self.num_migrated_out = 0
        # When the worker last answered (a step result, a SERVING health check; monotonic).
        self.heard_at = float("-inf")
        # The engine counters of the engines this replica has dropped (failed steps).
        self._dropped_engines = ReplicaCounters()
        self._watchdog = StepWatchdog(config)

    def counters(self) -> ReplicaCounters:
        """Since the replica was added, across engine replacements."""
        own = ReplicaCounters(num_steps=self.num_steps, num_migrated_out=self.num_migrated_out)
        if self.engine is not None:
            own = own.add(ReplicaCounters.of_engine(self.engine.get_stats()))
        return own.add(self._dropped_engines)

    @property
    def healthy(self) -> bool:
        return self.state is ReplicaState.READY

    def answered_since(self, since: float) -> bool:
        """Ready, and its worker answered (a step, a health check) after monotonic `since`."""
        return self.healthy and self.heard_at > since

    def _heard(self) -> None:
        self.heard_at = time.monotonic()

    @property
    def block_size(self) -> int:
        assert self.info is not None
        return self.info.block_size

    def _set_state(self, state: ReplicaState) -> None:
        if state is not self.state:
            log.info(
                "replica state", replica=self.replica_id, address=self.address, state=state.name
            )
            self.state = state
            self.report(events.StateChanged(self))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"replica-{self.replica_id}")
        self._health_task = asyncio.create_task(
            watch_health(
                self._health,
                self.config,
                lambda: self._stream is not None,
                self._heard,
                self.mark_lost,
                self._on_not_serving,
            ),
            name=f"replica-{self.replica_id}-health",
        )

    async def stop(self, cause: str = "removed") -> None:
        """End the loop; requests still here move elsewhere (`Evicted` with `cause`). The loop
        also ends at its next failure or wake-up if the cancellation is lost on its way (a
        removed replica that reconnected would hold its worker from every shard)."""
        self._stopping = True
        self._wake.set()
        tasks = [
            task
            for task in (self._health_task, self._task)
            if task is not None and task is not asyncio.current_task()
        ]
        for task in tasks:  # both at once: the loop is not left running while one ends
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._evict_all(cause)
        await self._channel.close()
        log.info("replica stopped", replica=self.replica_id, address=self.address, cause=cause)

    # -- requests (called by the fleet and its mover, on the same event loop) ------------------

    def place(self, snapshot: GroupSnapshot, trace: RequestTrace | None) -> None:
        """Queue a request (new or moved here). Raises the engine's RequestError if this
        replica's engine refuses it (and keeps no trace of it then)."""
        if self.engine is None or self.tracer is None:
            raise WorkerLostError("stream", f"worker {self.address} is not connected")
        self.engine.import_request(snapshot)
        self.tracer.attach(snapshot.request_id, trace)
        if self._steps is not None:
            self._steps.end_passes()
        self._wake.set()

    def abort_request(self, request_id: str) -> None:
        if self.engine is not None and self.engine.abort_request(request_id):
            if self.tracer is not None:
                self.tracer.abort(request_id)
            # Aborts free blocks now; the worker hears of it in the next step.
            self._wake.set()

    def take_requests(
        self, request_ids: list[str] | None = None
    ) -> tuple[list[GroupSnapshot], dict[str, RequestTrace | None]]:
        """Take requests out of the engine (all by default; unknown ids are skipped) with
        their traces, to continue elsewhere; they count as migrated out."""
        if self.engine is None:
            return [], {}
        snapshots = self.engine.export_requests(request_ids)
        traces = {}
        if self.tracer is not None:
            traces = {s.request_id: self.tracer.detach(s.request_id) for s in snapshots}
        self.num_migrated_out += len(snapshots)
        return snapshots, traces

    def num_unfinished(self) -> int:
        return 0 if self.engine is None else self.engine.get_num_unfinished_requests()

    # -- fleet controls --------------------------------------------------------------------------

    def drain(self) -> int:
        """Stop taking requests; move or finish those here. Returns how many there were.

        Policy (move_policy.drain_moves, which the fleet runs on each `DrainStep` reported
        here): waiting and swapped requests move at once by recompute (nothing of theirs is on
        the device). Running ones move at once with their KV blocks (`drain_migration`: a copy
        costs a step or two where a recompute re-runs the context); any that cannot (no replica
        to take them, `recompute` mode) may finish here for `drain_grace_s`, then move by
        recompute. With no other replica, moved requests wait for one (the fleet's pending
        queue).
        """
        if self.state is not ReplicaState.DRAINING:
            self.drain_started = time.monotonic()
            self._set_state(ReplicaState.DRAINING)
            if self.engine is None and self._task is not None:
                # Not connected (joining, or lost and retrying): nothing to move.
                self._task.cancel()
                self._task.add_done_callback(lambda _task: self.report(events.Drained(self)))
        self._wake.set()
        return self.num_unfinished()

    def mark_lost(self, cause: str, message: str) -> None:
        """The fleet gave up on the worker (health checks, lease): end the stream, which makes
        the loop evict every request and reconnect."""
        self._lost = WorkerLostError(cause, message)
        if self._stream is not None:
            self._stream.close()
        self._wake.set()

    def retry_now(self) -> None:
        """The worker registered (RegisterWorker): if the loop waits to reconnect after a
        loss, it connects now, and its backoff starts again from the shortest delay."""
        if self.state is ReplicaState.LOST:
            self._reconnect.registered()

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while self.state is not ReplicaState.DRAINING or self.engine is not None:
            if self._stopping:
                raise asyncio.CancelledError
            self._reconnect.connecting()
            try:
                await self._connect()
                self._reconnect.connected()
                await self._step_loop()
                break  # drained: nothing left on the replica
            except asyncio.CancelledError:
                raise
            except HeldElsewhereError as exc:  # another shard has it: the fleet lets go
                log.info("worker held by another scheduler", address=self.address, why=str(exc))
                self._evict_all("held")
                self.report(events.WorkerHeldElsewhere(self))
                return
            except (grpc.aio.AioRpcError, WorkerLostError, ConfigError) as exc:
                lost, refused = as_loss(exc)
                exc = self._lost or lost
                self._lost = None
                self._evict_all(exc.cause)
                if self.state is ReplicaState.DRAINING:
                    break
                self._set_state(ReplicaState.LOST)
                await self._reconnect.wait(self.replica_id, self.address, str(exc), refused)
            except Exception as exc:  # a bug or an injected fault in this replica's step
                log.exception("replica step failed", replica=self.replica_id, error=str(exc))
                self._fail_step(exc)
        # Closing the stream tells the worker that no sequence of it is left.
        self._reset()
        log.info(
            "replica drained",
            replica=self.replica_id,
            address=self.address,
            seconds=round(time.monotonic() - (self.drain_started or time.monotonic()), 3),
        )
        self.report(events.Drained(self))

    async def _connect(self) -> None:
        link = await open_worker(self._stub, self.config)
        self.info = link.info
        self._stream = ExecuteStream(self._stub)
        # An idle loop sleeps on _wake: a stream that ends meanwhile wakes it to reconnect,
        # rather than failing the next request that arrives.
        self._stream.on_close(self._wake.set)
        self.engine = link.new_engine()
        self.transfers = TransferQueue(self._wake.set)
        self.tracer = ReplicaTracer(self.replica_id, link.info.block_size)
        log.info(
            "replica ready", replica=self.replica_id, address=self.address, **link.log_fields()
        )
        if self.state is not ReplicaState.DRAINING:
            self._set_state(ReplicaState.READY)

    async def _step_loop(self) -> None:
        assert self.engine is not None and self._stream is not None and self.tracer is not None
        assert self.transfers is not None
        engine, stream, transfers = self.engine, self._stream, self.transfers
        self._steps = steps = StepPipeline(
            self.replica_id,
            self.address,
            engine,
            stream,
            self.tracer,
            self._watchdog,
            self.config.async_scheduling,
            transfers,
            lambda news, tokens, seconds: self.report(events.StepDone(self, news, tokens, seconds)),
        )
        idle_steps = 0
        while True:
            if self.state is ReplicaState.DRAINING:
                self.report(events.DrainStep(self))
                if not engine.has_unfinished_requests() and not transfers.busy:
                    return  # steps still in flight hold only finished sequences
            if not steps.in_flight:
                if not (engine.has_unfinished_requests() or transfers):
                    self._wake.clear()
                    metrics.record_stats(self.replica_id, engine.get_stats())
                    await self._wake.wait()
                if self._stopping:
                    raise asyncio.CancelledError
                if self._lost is not None:
                    raise self._lost
                if stream.closed:
                    raise WorkerLostError("stream", "the worker closed the Execute stream")
                if not (engine.has_unfinished_requests() or transfers):
                    continue  # woken by a drain or an abort with nothing left to run
                # A grammar a request is about to sample under compiles off the event loop;
                # this replica waits for it here (up to its deadline: a compile past it ends
                # its request at the next step), the others keep running.
                due, wait_s = engine.grammar_compiles_due()
                if due:
                    await wait_for_compiles(due, wait_s)
                    continue  # the replica may have changed meanwhile: check it again
                steps.begin()
            # With one step in flight, send the next before its result is back, if it can be.
            steps.try_continue()
            self._in_step = steps.request_ids()
            outputs, empty = await steps.finish_oldest()
            self._heard()
            self._in_step = steps.request_ids()
            self.num_steps += 1
            if outputs:
                self.report(events.Outputs(self, outputs))
            if empty and not outputs:
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

    # -- requests leaving ------------------------------------------------------------------------

    def _evict_all(self, cause: str) -> None:
        """Hand every request to the fleet and forget the engine and the stream."""
        snapshots, traces = self.take_requests()
        if snapshots:
            self.report(events.Evicted(self, snapshots, traces, cause))
        self._reset()

    def _fail_step(self, exc: BaseException) -> None:
        """A step raised. The engine may be half-updated, so it is dropped whole: the router
        continues every request from what its client received (the requests of the failed
        step count a failure each, so one that keeps failing steps is failed, not retried
        forever), and the loop reconnects with a fresh engine and stream."""
        in_step, self._in_step = self._in_step, []
        keys = [] if self.engine is None else self.engine.unfinished_request_ids()
        traces = {}
        if self.tracer is not None:
            traces = {key: self.tracer.detach(key) for key in keys}
        self._reset()
        self.num_migrated_out += len(keys)
        self.report(events.StepFailed(self, keys, in_step, exc, traces))

    def _reset(self) -> None:
        engine = self.engine
        self.engine, self.tracer, self.transfers, self._steps = None, None, None, None
        if engine is not None:
            engine_counters = ReplicaCounters.of_engine(engine.get_stats())
            self._dropped_engines = self._dropped_engines.add(engine_counters)
            self.report(events.EngineDropped(self, engine))
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    # -- health ------------------------------------------------------------------------------------

    def _on_not_serving(self) -> None:
        if self.state is ReplicaState.READY:
            log.info("worker reports NOT_SERVING; draining it", replica=self.replica_id)
            self.drain()
