"""What a replica is to the fleet: the states it goes through, its counters, and the events
that it and the KV mover report.

The fleet owns its replicas and its KV mover and calls down into them; neither calls back up.
What the fleet must act on comes back as an event, through the one callable each was given
(`Report`), and the fleet handles it by calling down again: into its own records, the mover
(`kv_mover`), the move policy (`move_policy`) or the replica's own methods. This is vLLM v1's
shape, where the scheduler's `update_from_output` returns what happened instead of reaching
into the engine core. All events are delivered on the event loop, synchronously: when
`report` returns, the fleet has acted.

Events name the replicas they concern by a type parameter (`R`, which is `replica.Replica`) so
that this module, which replica.py imports, does not import replica.py back. Build them
unsubscripted (`Evicted(replica, ...)`): a frozen, slotted generic dataclass cannot be built
through its subscripted form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from enum import IntEnum
from typing import Generic, TypeVar

from llmserve.v1 import scheduler_pb2
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.scheduler_outputs import SchedulerStats
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.tracing import RequestTrace
from scheduler_service.fleet.transfer_queue import TransferNews

R = TypeVar("R")


class ReplicaState(IntEnum):
    """Values equal the proto's WorkerState."""

    JOINING = scheduler_pb2.WORKER_STATE_JOINING
    READY = scheduler_pb2.WORKER_STATE_READY
    DRAINING = scheduler_pb2.WORKER_STATE_DRAINING
    LOST = scheduler_pb2.WORKER_STATE_LOST


# -- from a replica -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateChanged(Generic[R]):
    """`replica.state` changed."""

    replica: R


@dataclass(frozen=True, slots=True)
class StepDone(Generic[R]):
    """A step of `replica` finished: the news of the KV transfers it carried (None: it carried
    none), and the `tokens` it computed in `seconds`. Reported for every step, empty ones too,
    before its outputs."""

    replica: R
    news: TransferNews | None
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Outputs(Generic[R]):
    """A step's deltas, for the clients."""

    replica: R
    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class DrainStep(Generic[R]):
    """A draining replica is between steps (connected, at every turn of its loop): move what
    the drain policy says moves now (`move_policy.drain_moves`)."""

    replica: R


@dataclass(frozen=True, slots=True)
class Evicted(Generic[R]):
    """Requests left `replica` in a consistent state (its worker lost, removed, drained, or a
    KV move that fell back): place them on other replicas, where they continue by
    recompute."""

    replica: R
    snapshots: list[GroupSnapshot]
    traces: dict[str, RequestTrace | None]
    cause: str


@dataclass(frozen=True, slots=True)
class StepFailed(Generic[R]):
    """A step of `replica` raised and its engine was dropped whole: `request_ids` were on the
    replica, `in_step` in the failed step. They continue from what their clients received."""

    replica: R
    request_ids: list[str]
    in_step: list[str]
    error: BaseException
    traces: dict[str, RequestTrace | None]


@dataclass(frozen=True, slots=True)
class EngineDropped(Generic[R]):
    """`replica` dropped `engine` (its worker lost, a failed step, drained): moves from or to
    it fall back to recompute."""

    replica: R
    engine: LLMEngine


@dataclass(frozen=True, slots=True)
class WorkerHeldElsewhere(Generic[R]):
    """Another scheduler drives the replica's worker: the replica's loop has ended and it
    holds no request."""

    replica: R


@dataclass(frozen=True, slots=True)
class Drained(Generic[R]):
    """The replica finished draining (or its worker went away while draining): its loop has
    ended and it holds no request."""

    replica: R


# -- from the KV mover ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoveFinished(Generic[R]):
    """A move's last round is done (`kv_mover`): queue its request on `target`, or, if that
    replica cannot take it, anywhere but `source`, by recompute. `rounds`, `blocks` (copied)
    and `seconds` describe the move."""

    source: R
    target: R
    snapshot: GroupSnapshot
    trace: RequestTrace | None
    cause: str
    rounds: int
    blocks: int
    seconds: float


ReplicaEvent = (
    StateChanged[R]
    | StepDone[R]
    | Outputs[R]
    | DrainStep[R]
    | Evicted[R]
    | StepFailed[R]
    | EngineDropped[R]
    | WorkerHeldElsewhere[R]
    | Drained[R]
    | MoveFinished[R]
)
# How replicas and the mover report to the fleet.
Report = Callable[[ReplicaEvent[R]], None]


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
