"""What a replica is to the fleet: the states it goes through, and the owner it reports to."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from llmserve.v1 import scheduler_pb2
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.scheduler_outputs import SchedulerStats
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.tracing import RequestTrace

if TYPE_CHECKING:
    from scheduler_service.fleet.kv_mover import Migrations
    from scheduler_service.fleet.replica import Replica


class ReplicaState(IntEnum):
    """Values equal the proto's WorkerState."""

    JOINING = scheduler_pb2.WORKER_STATE_JOINING
    READY = scheduler_pb2.WORKER_STATE_READY
    DRAINING = scheduler_pb2.WORKER_STATE_DRAINING
    LOST = scheduler_pb2.WORKER_STATE_LOST


class ReplicaOwner(Protocol):
    """What a replica reports to (the fleet's router). All calls come from the event loop."""

    # Moves of running requests with their KV blocks (scheduler_service.fleet.kv_mover).
    migrations: Migrations

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's deltas."""

    def on_evicted(
        self,
        replica: Replica,
        snapshots: list[GroupSnapshot],
        traces: dict[str, RequestTrace | None],
        cause: str,
    ) -> None:
        """Requests leave the replica in a consistent state: place them elsewhere."""

    def on_step_failed(
        self,
        replica: Replica,
        request_ids: list[str],
        in_step: list[str],
        error: BaseException,
        traces: dict[str, RequestTrace | None],
    ) -> None:
        """A step raised: `request_ids` were on the replica, `in_step` in the failed step."""

    def on_state(self, replica: Replica) -> None:
        """`replica.state` changed."""

    def on_held_elsewhere(self, replica: Replica) -> None:
        """Another scheduler drives the replica's worker: the replica's loop has ended and it
        holds no request."""

    def on_drained(self, replica: Replica) -> None:
        """The replica finished draining (or its worker went away while draining): its loop
        has ended and it holds no request."""


@dataclass(slots=True)
class ReplicaCounters:
    """What replicas have done since the scheduler started. A replica's survive its engine
    being replaced (after a failed step); the fleet's survive a replica's removal."""

    num_steps: int = 0
    num_migrated_out: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def add(self, other: ReplicaCounters) -> ReplicaCounters:
        return ReplicaCounters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @classmethod
    def of_engine(cls, stats: SchedulerStats) -> ReplicaCounters:
        """The counters an engine keeps itself (reset when the engine is replaced)."""
        return cls(
            num_preemptions=stats.num_preemptions_recompute + stats.num_preemptions_swap,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )
