"""A stopped replica never connects again, even when the cancellation of its loop is lost on
the way (turned into a connection failure): a removed replica that reconnected would hold its
worker's Execute stream and keep every shard from driving it (found by the fault campaign)."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.ports import free_port
from scheduler_service.engine import SchedulerConfig
from scheduler_service.fleet import reconnect
from scheduler_service.fleet import replica as replica_module
from scheduler_service.fleet.fleet_config import ReplicaConfig
from scheduler_service.fleet.replica import Replica
from scheduler_service.fleet.worker_link import WorkerLostError


def test_a_stopped_replica_does_not_connect_again(monkeypatch: pytest.MonkeyPatch):
    attempts: list[str] = []

    async def open_worker_losing_a_cancellation(stub, config):  # type: ignore[no-untyped-def]
        attempts.append("connect")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if len(attempts) > 1:
                raise
            # As a transport can: the cancelled call surfaces as the connection's failure.
            raise WorkerLostError("stream", "cancelled") from None

    monkeypatch.setattr(replica_module, "open_worker", open_worker_losing_a_cancellation)
    monkeypatch.setattr(reconnect, "RETRY_DELAYS_S", (0.0,))

    async def main() -> bool:
        replica = Replica(
            0,
            f"127.0.0.1:{free_port()}",
            ReplicaConfig(SchedulerConfig(8, 64, 64, True)),
            lambda event: None,
        )
        replica.start()
        while not attempts:
            await asyncio.sleep(0)
        stopping = asyncio.create_task(replica.stop("lease"))
        # Bounded only so that a regression fails rather than hangs.
        done, _ = await asyncio.wait({stopping}, timeout=30)
        return stopping in done

    assert asyncio.run(main())
    assert attempts == ["connect"]
