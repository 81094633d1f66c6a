"""Which workers are the fleet's replicas, and why.

A worker becomes a replica through any of three sources, all kept live:
- `static`: the `--workers` list;
- `dns`: a name re-resolved every `dns_interval_s`, one replica per address (a compose service
  scaled to N, a Kubernetes headless Service). An address that leaves the answer loses the
  source;
- `lease`: `RegisterWorker`, renewed by the worker within `lease_s`. A lapsed lease loses the
  source, unless the replica is ready and its worker answered (a step, a health check) within
  `lease_s`: that answer renews the lease. A scheduler too busy to answer the renewals in time
  (they have a deadline of their own) thus keeps the workers it is stepping; a worker that
  left, died or hung answers nothing, and its lease lapses as before.
A replica that loses its last source is removed (stopped: its requests move). The loops that
watch the sources are in `fleet_watch`.

Shards. With several schedulers (shards) sharing the workers, a worker is driven by one of
them at a time (it takes one Execute stream). A replica whose worker another scheduler drives
leaves (`on_held_elsewhere`); a lease renewal adds it again at once (the worker chose this
shard), the other sources some seconds later, so a lost shard's workers are taken over.

Drain: a drained replica leaves once empty (`on_drained`); its address stays `drained` (no
source re-adds it) until the worker stops answering, so that a drained worker that keeps
running stays out.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.errors import NotFoundError
from llmserve.logs import get_logger
from scheduler_service.engine import metrics
from scheduler_service.fleet.discovery import DrainedError, HeldElsewhere
from scheduler_service.fleet.fleet_config import FleetConfig
from scheduler_service.fleet.replica import Replica
from scheduler_service.fleet.replica_events import ReplicaCounters, ReplicaState, Report

log = get_logger(__name__)

# The sources that make a worker a replica.
STATIC, DNS, LEASE = "static", "dns", "lease"


@dataclass(slots=True)
class Member:
    """A replica and the sources that keep it in the fleet."""

    replica: Replica
    sources: set[str] = field(default_factory=set)


class Membership:
    """The fleet's replicas by address and the sources that keep each, with what decides who
    joins: leases, drained addresses, workers other shards hold. Every replica it makes
    reports to `report` (the fleet's)."""

    def __init__(
        self,
        config: FleetConfig,
        report: Report[Replica],
        on_ready_change: Callable[[bool], None],
    ) -> None:
        self.config = config
        self._report = report
        self._on_ready_change = on_ready_change
        self.members: dict[str, Member] = {}
        self.static: list[str] = []
        self.leases: dict[str, float] = {}
        self.drained: dict[str, float] = {}
        self.held = HeldElsewhere()
        self._replica_ids = itertools.count()
        self._ready = False
        # Removed replicas: those still stopping, and the counters of those stopped.
        self._leaving: set[Replica] = set()
        self._departed = ReplicaCounters()

    def start(self, static: list[str]) -> None:
        self.static = list(static)
        for address in self.static:
            self.add(address, STATIC)

    async def stop(self) -> None:
        members = list(self.members.values())
        self.members.clear()
        await asyncio.gather(*(m.replica.stop() for m in members))

    @property
    def replicas(self) -> list[Replica]:
        return [m.replica for m in self.members.values()]

    def totals(self) -> ReplicaCounters:
        """Counters over every replica the fleet has had, removed ones included."""
        totals = self._departed
        for replica in [*self.replicas, *self._leaving]:
            totals = totals.add(replica.counters())
        return totals

    # -- sources -----------------------------------------------------------------------------

    def add(self, address: str, source: str) -> Replica:
        member = self.members.get(address)
        if member is None:
            replica = Replica(next(self._replica_ids), address, self.config.replica, self._report)
            member = self.members[address] = Member(replica)
            replica.start()
            log.info("replica added", replica=replica.replica_id, address=address, source=source)
            self.record_states()
        member.sources.add(source)
        return member.replica

    def register(self, address: str) -> Replica:
        """A lease registration or renewal. Raises DrainedError for a drained address that
        still runs (the worker should stop renewing)."""
        if address in self.drained:
            self.drained[address] = time.monotonic()
            raise DrainedError(address)
        self.leases[address] = time.monotonic() + self.config.lease_s
        self.held.forget(address)
        replica = self.add(address, LEASE)
        replica.retry_now()
        return replica

    def lapse_leases(self, now: float) -> None:
        """Drop the lease source of every address whose lease ended before `now`, unless its
        replica answered within the last `lease_s` (see the module's docstring)."""
        for address, expiry in list(self.leases.items()):
            if expiry >= now:
                continue
            member = self.members.get(address)
            if member is not None and member.replica.answered_since(now - self.config.lease_s):
                self.leases[address] = member.replica.heard_at + self.config.lease_s
                continue
            del self.leases[address]
            self.drop_source(address, LEASE, "lease")

    def drop_source(self, address: str, source: str, cause: str) -> None:
        member = self.members.get(address)
        if member is None:
            return
        member.sources.discard(source)
        if not member.sources:
            log.warning("replica removed", replica=member.replica.replica_id, cause=cause)
            del self.members[address]
            self._retire(member.replica, cause)
            self.record_states()

    def drain(self, address: str) -> tuple[Replica, int]:
        member = self.members.get(address)
        if member is None:
            raise NotFoundError(f"address: no worker {address!r} in the fleet", "address")
        return member.replica, member.replica.drain()

    # -- replicas leaving on their own (the fleet hands on their events) -------------------------

    def on_held_elsewhere(self, replica: Replica) -> None:
        member = self.members.get(replica.address)
        if member is not None and member.replica is replica:
            del self.members[replica.address]
            self.held.mark(replica.address, time.monotonic())
            self._retire(replica, "held")
            self.record_states()

    def on_drained(self, replica: Replica) -> None:
        member = self.members.get(replica.address)
        if member is not None and member.replica is replica:
            del self.members[replica.address]
            self.drained[replica.address] = time.monotonic()
            self.leases.pop(replica.address, None)
            self._retire(replica, "drain")
        if replica.drain_started is not None:
            metrics.DRAIN_SECONDS.observe(time.monotonic() - replica.drain_started)
        self.record_states()

    def _retire(self, replica: Replica, cause: str) -> None:
        """Stop a replica that left the fleet; its counters stay in `totals`."""
        self._leaving.add(replica)

        def stopped(_: asyncio.Task[None]) -> None:
            self._leaving.discard(replica)
            self._departed = self._departed.add(replica.counters())

        asyncio.create_task(replica.stop(cause)).add_done_callback(stopped)

    def record_states(self) -> None:
        states = [m.replica.state for m in self.members.values()]
        metrics.record_worker_states(states)
        ready = ReplicaState.READY in states
        if ready != self._ready:
            self._ready = ready
            self._on_ready_change(ready)
