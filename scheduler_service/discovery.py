"""Finding workers: DNS names that list them, whether an address still answers, and the
refusal of a drained worker that registers again while it still runs."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import security
from llmserve.errors import FailedPreconditionError
from llmserve.logs import get_logger

log = get_logger(__name__)


async def resolve_workers(name: str) -> set[str]:
    """The "ip:port" addresses that `name` ("host:port") resolves to; empty if none."""
    host, _, port = name.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:  # NXDOMAIN while no replica exists is normal
        log.debug("worker DNS lookup failed", name=host, error=str(exc))
        return set()
    return {f"{info[4][0]}:{port}" for info in infos}


async def answers_health(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a process answers health checks at `address` (whatever its status)."""
    try:
        async with security.aio_channel(address) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
    except grpc.aio.AioRpcError:
        return False
    return True


class DrainedError(FailedPreconditionError):
    """A drained worker tried to register again while still running."""

    def __init__(self, address: str) -> None:
        super().__init__(
            f"address: worker {address} was drained; it rejoins once restarted "
            "(after it stops answering health checks)",
            "address",
        )
