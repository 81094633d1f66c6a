"""What the fleet and its replicas are configured with, and what the fleet needs from the router
of gateway requests."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from llmserve.errors import ApiError
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.placement import RoutingPolicy

# Disaggregated serving: prompts with fewer tokens than this uncached on a decode worker prefill
# there (scheduler_service.fleet.roles).
DEFAULT_PREFILL_LOCAL_BELOW = 128
# Prefix fetch: a request placed where this many fewer of its prompt's tokens are cached than on
# another replica copies them from there first, if the measured rates favour it
# (scheduler_service.fleet.move_policy.maybe_fetch). 0: never.
DEFAULT_PREFIX_FETCH_MIN_TOKENS = 64


class MigrationMode(Enum):
    """How a draining replica's running requests move (`scheduler_service.fleet.kv_mover`)."""

    # With their KV blocks, copied while they decode, then a short stop for the rest.
    PRE_COPY = "pre-copy"
    # With their KV blocks, stopped for the whole copy.
    STOP_AND_COPY = "stop-and-copy"
    # By recompute on the target, after `drain_grace_s`.
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """What the scheduler service decides for every replica (the worker decides the rest)."""

    scheduler: SchedulerConfig
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_cpu_blocks_override: int | None = None
    max_message_bytes: int = 64 * 1024 * 1024
    # A step whose result has not come back after this long marks the worker lost. None: the
    # larger of `watchdog_floor_s` and `watchdog_factor` times the slowest step seen so far.
    step_watchdog_s: float | None = None
    watchdog_floor_s: float = 30.0
    watchdog_factor: float = 20.0
    # Health checks of a connected worker; this many failures in a row mark it lost.
    health_interval_s: float = 2.0
    health_failures: int = 3
    # Drain policy: running requests move with their KV blocks at once (`drain_migration`);
    # any still there after `drain_grace_s` (none could take them that way) move by recompute.
    drain_grace_s: float = 10.0
    drain_migration: MigrationMode = MigrationMode.PRE_COPY
    # Send a step's continuation before its result is back (scheduler_service.engine.pipelined_steps).
    async_scheduling: bool = True


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replica: ReplicaConfig
    routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    # "host:port" re-resolved every dns_interval_s, several comma-separated; empty: no DNS
    # discovery.
    worker_dns: str = ""
    dns_interval_s: float = 5.0
    # Workers re-register within this long or count as lost.
    lease_s: float = 10.0
    # A request with no ready replica waits this long, then fails UNAVAILABLE.
    no_worker_timeout_s: float = 30.0
    # A request in this many failed steps is failed rather than retried again.
    max_step_failures: int = 2
    # Disaggregated serving: with prefill workers, a prompt with fewer tokens than this
    # uncached on a decode worker prefills there rather than on a prefill worker.
    prefill_local_below: int = DEFAULT_PREFILL_LOCAL_BELOW
    # Prefix fetch from a peer replica: the least gain in cached tokens worth a copy (0: off).
    prefix_fetch_min_tokens: int = DEFAULT_PREFIX_FETCH_MIN_TOKENS
    # This scheduler's name among the shards (on traces, metrics and GetStats).
    shard: str = ""


class FleetOwner(Protocol):
    """What the fleet needs from the router of gateway requests (see router.Router)."""

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's deltas, for the requests' gateways."""

    def fail_request(self, key: str, error: ApiError) -> None:
        """The request cannot go on: answer its gateway with this error and forget it."""

    def is_routed(self, key: str) -> bool:
        """Whether a gateway still waits for the request (not finished, aborted or failed)."""

    def resume_snapshot(self, key: str) -> GroupSnapshot | None:
        """The request rebuilt from what its client received (after a failed step)."""

    def count_step_failure(self, key: str) -> int:
        """One more failed step for the request; returns how many it has been in."""
