"""The Scheduler gRPC service: every RPC is one call into the `Router` (router.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from llmserve.errors import FieldError
from llmserve.logs import get_logger
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_service.fleet.messages import take_batch
from scheduler_service.fleet.router import GatewayStream, Router

__all__ = ["Router", "SchedulerServicer"]

log = get_logger(__name__)


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FieldError("address", f"must be host:port, got {address!r}")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Thin: every RPC is one call into the Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        _check_address(request.address)
        replica = self.router.fleet.register(request.address)
        return scheduler_pb2.RegisterWorkerResponse(
            replica_id=replica.replica_id,
            lease_ms=int(self.router.fleet.config.lease_s * 1000),
        )

    async def DrainWorker(
        self, request: scheduler_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DrainWorkerResponse:
        _check_address(request.address)
        replica, num_requests = self.router.fleet.drain(request.address)
        log.info("drain requested", address=request.address, requests=num_requests)
        return scheduler_pb2.DrainWorkerResponse(
            replica_id=replica.replica_id, num_requests=num_requests
        )

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        return self.router.stats(check_invariants=request.check_invariants)

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.GatewayMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        stream = self.router.open_stream(context.peer())
        log.info("gateway connected", stream=stream.stream_id, peer=stream.peer)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while (message := await stream.outbox.get()) is not None:
                for batch in take_batch(message, stream.outbox):
                    yield batch
        finally:
            reader.cancel()
            self.router.close_stream(stream)
            log.info("gateway disconnected", stream=stream.stream_id)

    async def _read(
        self, request_iterator: AsyncIterator[scheduler_pb2.GatewayMessage], stream: GatewayStream
    ) -> None:
        try:
            async for received in request_iterator:
                batch = received.WhichOneof("kind") == "batch"
                for message in received.batch.messages if batch else (received,):
                    kind = message.WhichOneof("kind")
                    if kind == "add":
                        self.router.add(stream, message.add)
                    elif kind == "abort":
                        self.router.abort(stream, message.abort.request_id)
                    # A batch inside a batch is not a message a gateway sends: ignored.
        finally:
            stream.outbox.put_nowait(None)
