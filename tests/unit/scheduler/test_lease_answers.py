"""A lapsed lease and a replica that is answering: the answer renews the lease.

A scheduler whose loop is too busy to answer a worker's renewals within their deadline (two
workers, a gateway and the scheduler on two slow cores) used to drop the replica it was
stepping, and add it again a moment later under a new id, moving its requests for nothing.
Against a real Worker service (a simulated worker on loopback) that joined with one lease and
never renews it; the clock `lapse_leases` is given is set past the lease's end, so nothing
here waits for the lease to run out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet import reconnect
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
from scheduler_service.fleet.membership import Membership
from scheduler_service.fleet.replica import Replica
from scheduler_service.fleet.replica_events import ReplicaState
from tests.support.simulated_fleet import SimulatedServer, serve_simulated
from tests.support.simulated_worker import SimulatedConfig

LEASE_S = 30.0
CONFIG = FleetConfig(
    ReplicaConfig(
        SchedulerConfig(8, 256, 256, True), num_gpu_blocks_override=64, health_interval_s=0.1
    ),
    lease_s=LEASE_S,
)


async def until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    """Bounded only so that a regression fails rather than hangs."""
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def joined() -> AsyncIterator[tuple[SimulatedServer, Membership, Replica]]:
    """A simulated worker registered now, and its replica once ready and heard from after
    joining (the lease is never renewed)."""
    server = await serve_simulated(SimulatedConfig(num_gpu_blocks=64, max_model_len=256), None)
    membership = Membership(CONFIG, lambda event: None, lambda ready: None)
    try:
        registered = time.monotonic()
        replica = membership.register(server.address)
        await until(lambda: replica.answered_since(registered), "the replica's first answer")
        yield server, membership, replica
    finally:
        await membership.stop()
        await server.stop()


def test_a_replica_answering_keeps_its_lapsed_lease():
    async def main() -> None:
        async with joined() as (server, membership, replica):
            expiry = membership.leases[server.address]
            # Past the lease's end, within LEASE_S of the worker's last answer: kept.
            membership.lapse_leases(replica.heard_at + LEASE_S - 1e-3)
            assert membership.members[server.address].replica is replica
            assert membership.leases[server.address] > expiry

    asyncio.run(main())


def test_a_replica_silent_for_a_lease_loses_it():
    async def main() -> None:
        async with joined() as (server, membership, replica):
            # Ready, but its last answer is a whole lease old at this clock: removed.
            membership.lapse_leases(replica.heard_at + LEASE_S + 1e-3)
            assert server.address not in membership.members
            assert server.address not in membership.leases

    asyncio.run(main())


def test_a_lost_worker_loses_its_lease_however_recently_heard():
    async def main() -> None:
        async with joined() as (server, membership, replica):
            heard = replica.heard_at
            await server.stop()
            await until(lambda: not replica.healthy, "the stopped worker's loss")
            membership.lapse_leases(max(heard, membership.leases[server.address]) + 1e-3)
            assert server.address not in membership.members

    asyncio.run(main())


def test_a_registration_ends_a_lost_replicas_backoff(monkeypatch):
    """A worker that comes back at a lost replica's address says so by registering: the
    replica reconnects then, not when its backoff runs out. The backoff here is an hour, so
    only the registration can bring the replica back within `until`'s bound."""
    monkeypatch.setattr(reconnect, "RETRY_DELAYS_S", (3600.0,))

    async def main() -> None:
        async with joined() as (server, membership, replica):
            port = int(server.address.rsplit(":", 1)[1])
            await server.stop()
            await until(lambda: replica.state is ReplicaState.LOST, "the stopped worker's loss")
            config = SimulatedConfig(num_gpu_blocks=64, max_model_len=256)
            back = await serve_simulated(config, None, port=port)
            try:
                assert membership.register(back.address) is replica  # the same member
                await until(lambda: replica.healthy, "the returned worker's replica ready")
            finally:
                await back.stop()

    asyncio.run(main())
