"""What the fleet and its replicas are configured with, and what the fleet needs from the router
of gateway requests."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from llmserve.config_flags import flag
from llmserve.errors import ApiError
from llmserve.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES
from scheduler_service.engine.config import ConfigError, SchedulerConfig
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.placement import RoutingPolicy


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
    watermark: float = flag(
        0.01,
        "fraction of device blocks kept free when admitting prompts, so running sequences can "
        "grow without preempting at once",
    )
    enable_prefix_caching: bool = flag(True, "share the KV blocks of identical prompt prefixes")
    num_gpu_blocks_override: int | None = flag(
        None, "device KV blocks to ask each worker for, in place of what it offers"
    )
    num_cpu_blocks_override: int | None = flag(
        None, "host (swap) KV blocks to ask each worker for, in place of what it offers"
    )
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A step whose result has not come back after this long marks the worker lost. None: the
    # larger of `watchdog_floor_s` and `watchdog_factor` times the slowest step seen so far.
    step_watchdog_s: float | None = flag(
        None,
        "a step without a result after this long marks its worker lost (unset: the larger of "
        "30 s and 20x the slowest step seen)",
    )
    watchdog_floor_s: float = 30.0
    watchdog_factor: float = 20.0
    # Health checks of a connected worker; this many failures in a row mark it lost.
    health_interval_s: float = flag(
        2.0, "health checks of each worker; 3 failures in a row mark it lost"
    )
    health_failures: int = 3
    # Drain policy: running requests move with their KV blocks at once (`drain_migration`);
    # any still there after `drain_grace_s` (none could take them that way) move by recompute.
    drain_grace_s: float = flag(
        10.0,
        "running requests of a draining worker that cannot move with their KV blocks may "
        "finish there for this long before they move by recompute",
    )
    drain_migration: MigrationMode = flag(
        MigrationMode.PRE_COPY,
        "how a draining worker's running requests move: with their KV blocks, copied while "
        "they decode (pre-copy) or while they wait (stop-and-copy), or by recompute",
    )
    # Send a step's continuation before its result is back
    # (scheduler_service.engine.pipelined_steps).
    async_scheduling: bool = flag(
        True,
        "send each decode step to the worker before the previous step's result is back, so "
        "the worker does not wait for the round trip and the scheduling (outputs are the same "
        "either way)",
    )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replica: ReplicaConfig
    routing: RoutingPolicy = flag(
        RoutingPolicy.CACHE_AWARE,
        "cache_aware weighs each worker's cached prefix of the prompt against its load",
    )
    # "host:port" re-resolved every dns_interval_s, several comma-separated; empty: no DNS
    # discovery.
    worker_dns: str = flag(
        "",
        "host:port whose name is re-resolved every --dns-interval-s, one worker per address (a "
        "compose service scaled to N, a Kubernetes headless Service); several comma-separated "
        "(e.g. prefill and decode workers' services)",
    )
    dns_interval_s: float = flag(5.0, "how often --worker-dns is resolved again")
    lease_s: float = flag(
        10.0,
        "workers that joined with RegisterWorker renew within this long or count as lost",
        name="worker_lease_s",
    )
    no_worker_timeout_s: float = flag(
        30.0, "a request waits this long for a ready worker, then fails UNAVAILABLE"
    )
    # A request in this many failed steps is failed rather than retried again.
    max_step_failures: int = 2
    # Disaggregated serving (scheduler_service.fleet.roles): with prefill workers, a prompt
    # with fewer tokens than this uncached on a decode worker prefills there rather than on a
    # prefill worker.
    prefill_local_below: int = flag(
        128,
        "disaggregated serving (workers with --role): a prompt with fewer tokens than this not "
        "cached on a decode worker prefills there instead of on a prefill worker",
    )
    # Prefix fetch from a peer replica (scheduler_service.fleet.move_policy.maybe_fetch): the
    # least gain in cached tokens worth a copy, if the measured rates favour it (0: off).
    prefix_fetch_min_tokens: int = flag(
        64,
        "a request placed on a worker that holds this many fewer of its prompt's tokens cached "
        "than another worker copies those KV blocks from there first, when the measured "
        "transfer and prefill rates say it is faster (0: never)",
    )
    # A request's new tokens wait in the router until this many have gathered
    # (`router._due`); its first tokens, its end, an error and prompt logprobs go at once.
    stream_interval: int = flag(
        1,
        "tokens a request gathers before the scheduler sends them to its gateway (its first "
        "tokens and its end go at once): above 1, fewer messages, chunks and socket writes "
        "per token under many streams, and the text arrives in coarser pieces",
    )
    # This scheduler's name among the shards (on traces, metrics and GetStats).
    shard: str = ""

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ConfigError("stream_interval", f"must be at least 1, got {self.stream_interval}")


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
