"""A lapsed lease and a replica that is answering: the answer renews the lease.

A scheduler whose loop is too busy to answer a worker's renewals within their deadline (two
workers, a gateway and the scheduler on two slow cores) used to drop the replica it was
stepping, and add it again a moment later under a new id, moving its requests for nothing.
Against a real Worker service (a simulated worker on loopback) that joined with one lease and
never renews it; the clock `lapse_leases` is given is set past the lease's end, so nothing
here waits for the lease to run out."""

from __future__ import annotations

import asyncio
import time

from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
from scheduler_service.fleet.membership import Membership
from scheduler_service.fleet.replica import Replica
from tests.support.simulated_fleet import serve_simulated
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


async def joined_and_heard(membership: Membership, address: str) -> Replica:
    """The replica of a worker registered now, once ready and heard from after joining."""
    registered = time.monotonic()
    replica = membership.register(address)
    await until(lambda: replica.answered_since(registered), "the replica's first answer")
    return replica


def test_a_replica_answering_keeps_its_lapsed_lease():
    async def main() -> None:
        server = await serve_simulated(SimulatedConfig(num_gpu_blocks=64, max_model_len=256), None)
        membership = Membership(CONFIG, lambda event: None, lambda ready: None)
        try:
            replica = await joined_and_heard(membership, server.address)
            expiry = membership.leases[server.address]
            heard = replica.heard_at
            # Past the lease's end, within LEASE_S of the worker's last answer: kept.
            membership.lapse_leases(heard + LEASE_S - 1e-3)
            assert membership.members[server.address].replica is replica
            assert membership.leases[server.address] > expiry
        finally:
            await membership.stop()
            await server.stop()

    asyncio.run(main())


def test_a_replica_silent_for_a_lease_loses_it():
    async def main() -> None:
        server = await serve_simulated(SimulatedConfig(num_gpu_blocks=64, max_model_len=256), None)
        membership = Membership(CONFIG, lambda event: None, lambda ready: None)
        try:
            replica = await joined_and_heard(membership, server.address)
            # Ready, but its last answer is a whole lease old at this clock: removed.
            membership.lapse_leases(replica.heard_at + LEASE_S + 1e-3)
            assert server.address not in membership.members
            assert server.address not in membership.leases
        finally:
            await membership.stop()
            await server.stop()

    asyncio.run(main())


def test_a_lost_worker_loses_its_lease_however_recently_heard():
    async def main() -> None:
        server = await serve_simulated(SimulatedConfig(num_gpu_blocks=64, max_model_len=256), None)
        membership = Membership(CONFIG, lambda event: None, lambda ready: None)
        try:
            replica = await joined_and_heard(membership, server.address)
            heard = replica.heard_at
            await server.stop()
            await until(lambda: not replica.healthy, "the stopped worker's loss")
            membership.lapse_leases(max(heard, membership.leases[server.address]) + 1e-3)
            assert server.address not in membership.members
        finally:
            await membership.stop()

    asyncio.run(main())
