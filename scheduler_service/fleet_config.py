"""What the fleet is configured with, and what it needs from the router of gateway requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from llmserve.errors import ApiError
from scheduler_service.config import (
    DEFAULT_PREFILL_LOCAL_BELOW,
    DEFAULT_PREFIX_FETCH_MIN_TOKENS,
    ReplicaConfig,
)
from scheduler_service.migration import GroupSnapshot
from scheduler_service.request_output import RequestOutput
from scheduler_service.routing import RoutingPolicy


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
