"""A fake Scheduler servicer on a real loopback gRPC server, and a hang-guarded wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

HANG_GUARD_S = 30.0  # only bounds a broken test; nothing asserts on durations


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Grants `lease_ms` as replica `replica_id` (or, after `refuse_registrations`, refuses as
    the real scheduler refuses a drained worker); DrainWorker answers `drain_code` or OK;
    GetStats lists `num_replicas` ready replicas."""

    def __init__(self, replica_id: int, lease_ms: int, drain_code: grpc.StatusCode | None = None):
        self.replica_id = replica_id
        self.lease_ms = lease_ms
        self.drain_code = drain_code
        self.registered: list[str] = []
        self.drained: list[str] = []
        self.refuse_registrations = False
        self.num_replicas = 0

    async def RegisterWorker(self, request, context):  # type: ignore[no-untyped-def]
        self.registered.append(request.address)
        if self.refuse_registrations:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "address: drained")
        return scheduler_pb2.RegisterWorkerResponse(
            replica_id=self.replica_id, lease_ms=self.lease_ms
        )

    async def DrainWorker(self, request, context):  # type: ignore[no-untyped-def]
        self.drained.append(request.address)
        if self.drain_code is not None:
            await context.abort(self.drain_code, "refused by the fake")
        return scheduler_pb2.DrainWorkerResponse(replica_id=self.replica_id, num_requests=3)

    async def GetStats(self, request, context):  # type: ignore[no-untyped-def]
        ready = scheduler_pb2.ReplicaStats(state=scheduler_pb2.WORKER_STATE_READY)
        return scheduler_pb2.GetStatsResponse(replicas=[ready] * self.num_replicas)


async def serve(fake: scheduler_pb2_grpc.SchedulerServicer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition`, re-checked every 10 ms."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():
            await asyncio.sleep(0.01)
