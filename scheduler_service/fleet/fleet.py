"""The worker fleet: its replicas, where each request runs, and what it does as they report.

The fleet owns its replicas (through `Membership`: which workers are replicas, and why) and its
KV mover (`kv_mover`), and calls down into them; they never call it. They report events
(`replica_events`) to `_on_event`, which acts on each by calling down again: placing requests,
asking the move policy (`move_policy`), driving the mover, taking requests off a replica.

Placement. Every request is placed by the routing policy on a READY replica, by worker role
(`roles`), fetching a longer cached prefix from a peer first where that pays (`move_policy`).
With none ready, it waits in `pending` (in arrival order) for up to `no_worker_timeout_s`, then
fails UNAVAILABLE saying so; a replica that becomes ready takes the pending ones.

Migration. Requests leaving a replica (its worker lost, drained, removed, or a failed step)
are placed again elsewhere with every token generated so far: they continue by recompute, and
clients see a pause, never an error or a different token. Drains and prefill workers' hand-offs
move running requests with their KV blocks instead (`kv_mover`).

Drain (`DrainWorker`, or the worker's health turning NOT_SERVING): the replica takes nothing
new and moves its requests per `Replica.drain`'s policy (`DrainStep`); once empty it closes the
worker's stream and leaves the fleet (`membership`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

from llmserve.errors import FieldError, InternalError, UnavailableError
from llmserve.logs import get_logger
from scheduler_service.engine import metrics
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.fleet_config import FleetConfig, FleetOwner
from scheduler_service.fleet.fleet_watch import housekeeping, watch_dns
from scheduler_service.fleet.kv_mover import KvMover, record_landing
from scheduler_service.fleet.membership import Membership
from scheduler_service.fleet.move_policy import after_step, drain_moves, maybe_fetch
from scheduler_service.fleet.placement import Candidate, Decision, ReplicaChooser
from scheduler_service.fleet.replica import Replica, ReplicaState, WorkerLostError
from scheduler_service.fleet.replica_events import (
    Drained,
    DrainStep,
    EngineDropped,
    Evicted,
    MoveFinished,
    Outputs,
    ReplicaCounters,
    ReplicaEvent,
    StateChanged,
    StepDone,
    StepFailed,
    WorkerHeldElsewhere,
)
from scheduler_service.fleet.roles import choose, role_name
from scheduler_service.fleet.tracing import (
    RequestTrace,
    end_request_trace,
    record_migration,
    record_routing,
)

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class _Pending:
    snapshot: GroupSnapshot
    trace: RequestTrace | None
    deadline: float


class Fleet:
    """Replicas, the placement of requests on them, and the moves between them."""

    def __init__(
        self,
        config: FleetConfig,
        owner: FleetOwner,
        on_ready_change: Callable[[bool], None] = lambda ready: None,
    ) -> None:
        self.config = config
        self.owner = owner
        self.membership = Membership(config, self._on_event, on_ready_change)
        self.mover = KvMover(self._on_event, config.replica.drain_migration)
        self._chooser = ReplicaChooser(config.routing)
        self.location: dict[str, Replica] = {}
        self.pending: dict[str, _Pending] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- life ------------------------------------------------------------------------------------

    def start(self, static: list[str]) -> None:
        self.membership.start(static)
        self._tasks.append(
            asyncio.create_task(
                housekeeping(self.membership, self._expire_pending), name="fleet-housekeeping"
            )
        )
        if self.config.worker_dns:
            self._tasks.append(asyncio.create_task(watch_dns(self.membership), name="fleet-dns"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.membership.stop()

    @property
    def replicas(self) -> list[Replica]:
        return self.membership.replicas

    def totals(self) -> ReplicaCounters:
        """Counters over every replica the fleet has had, removed ones included."""
        return self.membership.totals()

    def register(self, address: str) -> Replica:
        """A lease registration or renewal (`Membership.register`)."""
        return self.membership.register(address)

    def drain(self, address: str) -> tuple[Replica, int]:
        return self.membership.drain(address)

    # -- placement -------------------------------------------------------------------------------

    def _pick(
        self, prompt: list[int], source: Replica | None, placing: bool = True
    ) -> tuple[Replica, Decision] | None:
        """The ready replica (not `source`) the routing policy picks for `prompt`: to place
        a request (`placing`), or as the target of a move (`roles.choose`)."""
        local_below = self.config.prefill_local_below if placing else None
        return choose(self._connected(source), prompt, local_below, self._route)

    def _connected(self, but: Replica | None = None) -> list[Replica]:
        """The connected READY replicas, `but` excepted."""
        return [
            r
            for r in self.membership.replicas
            if r.state is ReplicaState.READY and r.engine and r is not but
        ]

    def _route(self, replicas: list[Replica], prompt: list[int]) -> tuple[Replica, Decision] | None:
        by_id = {r.replica_id: r for r in replicas}
        candidates = [Candidate(r.replica_id, r.engine) for r in replicas if r.engine]
        decision = self._chooser.pick(candidates, prompt)
        return None if decision is None else (by_id[decision.replica_id], decision)

    def place(
        self,
        snapshot: GroupSnapshot,
        trace: RequestTrace | None,
        source: Replica | None = None,
        cause: str = "",
    ) -> None:
        """Put a request on a ready replica (not `source`), or in `pending`. Raises the
        engine's RequestError if the chosen replica can never run it."""
        key = snapshot.request_id
        picked = self._pick(snapshot.prompt_token_ids, source)
        if picked is None:
            deadline = time.monotonic() + self.config.no_worker_timeout_s
            self.pending[key] = _Pending(snapshot, trace, deadline)
            if source is not None:
                record_migration(trace, source.address, "(pending)", cause)
            return
        target, decision = picked
        if source is None and self._fetch(snapshot, trace, target, decision.cached_tokens):
            return  # queued on the target once the prefix has arrived
        try:
            target.place(snapshot, trace)
        except WorkerLostError:  # the replica lost its worker this instant: wait for another
            self.pending[key] = _Pending(
                snapshot, trace, time.monotonic() + self.config.no_worker_timeout_s
            )
            return
        self.location[key] = target
        metrics.record_routing(self.config.routing.value, decision.cached_tokens > 0)
        record_routing(trace, target.address, self.config.routing.value, decision.cached_tokens)
        if source is not None:
            self._moved(key, trace, source, target, cause, "recompute")

    def _moved(
        self,
        key: str,
        trace: RequestTrace | None,
        source: Replica,
        target: Replica,
        cause: str,
        how: str,
    ) -> None:
        record_migration(trace, source.address, target.address, cause, how)
        metrics.MIGRATIONS.labels(cause).inc()
        log.info("request migrated", request=key, cause=cause, how=how,
                 from_worker=source.address, to_worker=target.address)  # fmt: skip

    # -- moves with KV blocks (kv_mover, move_policy) -------------------------------------------

    def _fetch(
        self, snapshot: GroupSnapshot, trace: RequestTrace | None, target: Replica, cached: int
    ) -> bool:
        peers, min_tokens = self._connected(), self.config.prefix_fetch_min_tokens
        return maybe_fetch(self.mover, peers, target, cached, snapshot, trace, min_tokens)

    def _pick_target(self, source: Replica, prompt: list[int]) -> Replica | None:
        """The ready replica (not `source`) the routing policy would move `prompt` to."""
        picked = self._pick(prompt, source, placing=False)
        return None if picked is None else picked[0]

    def abort(self, key: str) -> None:
        self.mover.abort(key)  # stopped mid-move: not queued anywhere after it
        pending = self.pending.pop(key, None)
        if pending is not None:
            end_request_trace(pending.trace, None)
        replica = self.location.pop(key, None)
        if replica is not None:
            replica.abort_request(key)

    def finished(self, key: str) -> None:
        self.location.pop(key, None)

    def _place_pending(self) -> None:
        """Place waiting requests in arrival order while a replica is ready."""
        for key in list(self.pending):
            if not any(r.healthy and r.engine for r in self.membership.replicas):
                return
            pending = self.pending.pop(key)
            self._place_or_fail(pending.snapshot, pending.trace, None, "")

    def _expire_pending(self, now: float) -> None:
        """Fail the requests that have waited for a ready replica past their deadline."""
        for key, pending in list(self.pending.items()):
            if pending.deadline <= now:
                del self.pending[key]
                message = (
                    f"no worker became available within {self.config.no_worker_timeout_s:g} s "
                    f"({len(self.membership.members)} known, none ready)"
                )
                end_request_trace(pending.trace, message)
                self.owner.fail_request(key, UnavailableError(message))

    def _place_or_fail(
        self,
        snapshot: GroupSnapshot,
        trace: RequestTrace | None,
        source: Replica | None,
        cause: str,
    ) -> None:
        try:
            self.place(snapshot, trace, source, cause)
        except FieldError as exc:
            end_request_trace(trace, exc.message)
            self.owner.fail_request(snapshot.request_id, exc)

    # -- what replicas and the mover report ------------------------------------------------------

    def _on_event(self, event: ReplicaEvent[Replica]) -> None:
        """Every event of every replica and of the mover comes here, on the event loop."""
        match event:
            case Outputs():
                self.owner.on_outputs(event.outputs)
            case StepDone():
                after_step(self.mover, event, self._pick_target)
            case DrainStep():
                self._drain_step(event.replica)
            case Evicted():
                self._place_evicted(event.replica, event.snapshots, event.traces, event.cause)
            case StepFailed():
                self._on_step_failed(event)
            case EngineDropped():
                self.mover.on_engine_dropped(event.engine)
            case StateChanged():
                self._on_state(event.replica)
            case WorkerHeldElsewhere():
                self.membership.on_held_elsewhere(event.replica)
            case Drained():
                self.membership.on_drained(event.replica)
            case MoveFinished():
                self._land(event)
            case _:
                assert_never(event)

    def _place_evicted(
        self,
        replica: Replica,
        snapshots: list[GroupSnapshot],
        traces: dict[str, RequestTrace | None],
        cause: str,
    ) -> None:
        for snapshot in snapshots:
            key = snapshot.request_id
            self.location.pop(key, None)
            if not self.owner.is_routed(key):
                end_request_trace(traces.get(key), None)
                continue
            self._place_or_fail(snapshot, traces.get(key), replica, cause)

    def _drain_step(self, replica: Replica) -> None:
        """Between steps of a draining replica: start the moves the drain policy asks for, and
        place elsewhere what moves by recompute now."""
        assert replica.engine is not None and replica.drain_started is not None
        late = time.monotonic() >= replica.drain_started + self.config.replica.drain_grace_s
        recompute = drain_moves(self.mover, replica, replica.engine, late, self._pick_target)
        if recompute:
            snapshots, traces = replica.take_requests(recompute)
            self._place_evicted(replica, snapshots, traces, "drain")

    def _land(self, moved: MoveFinished[Replica]) -> None:
        """A move's last round is done: queue its request on the target, or, if the target
        cannot take it, anywhere else by recompute."""
        placed = moved.target.state is ReplicaState.READY and self._place_moved(moved)
        record_landing(moved, placed)
        if not placed:
            traces = {moved.snapshot.request_id: moved.trace}
            self._place_evicted(moved.source, [moved.snapshot], traces, moved.cause)

    def _place_moved(self, moved: MoveFinished[Replica]) -> bool:
        key = moved.snapshot.request_id
        if not self.owner.is_routed(key):
            end_request_trace(moved.trace, None)
            return True
        try:
            moved.target.place(moved.snapshot, moved.trace)
        except (WorkerLostError, FieldError):
            return False
        self.location[key] = moved.target
        self._moved(key, moved.trace, moved.source, moved.target, moved.cause, "transfer")
        return True

    def _on_step_failed(self, failed: StepFailed[Replica]) -> None:
        replica = failed.replica
        if replica.state is ReplicaState.READY:
            replica.state = ReplicaState.JOINING  # until it has reconnected
            self.membership.record_states()
        for key in failed.request_ids:
            self.location.pop(key, None)
            trace = failed.traces.get(key)
            failures = self.owner.count_step_failure(key) if key in failed.in_step else 0
            snapshot = self.owner.resume_snapshot(key)
            if snapshot is None:
                end_request_trace(trace, None)
                continue
            if failures >= self.config.max_step_failures:
                message = (
                    f"the request failed {failures} scheduler steps; last error: {failed.error}"
                )
                end_request_trace(trace, message)
                self.owner.fail_request(key, InternalError(message))
                continue
            self._place_or_fail(snapshot, trace, replica, "step_failed")

    def _on_state(self, replica: Replica) -> None:
        self.membership.record_states()
        if replica.state is ReplicaState.READY:
            metrics.record_role(replica.replica_id, role_name(replica))
        if replica.state is ReplicaState.READY and self.pending:
            self._place_pending()
