"""Finding workers: DNS names that list them, whether an address still answers, the refusal
of a drained worker that registers again while it still runs, and the workers another
scheduler shard drives."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import security
from llmserve.errors import FailedPreconditionError
from llmserve.logs import get_logger

log = get_logger(__name__)

# A worker another scheduler drove is tried again by DNS and static sources after this long.
HELD_RETRY_S = 5.0


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


class HeldElsewhere:
    """Workers another scheduler (shard) drove when this one last tried to connect, and when:
    a source other than the worker's own lease tries one again `retry_s` later."""

    def __init__(self, retry_s: float = HELD_RETRY_S) -> None:
        self.retry_s = retry_s
        self.since: dict[str, float] = {}

    def mark(self, address: str, now: float) -> None:
        self.since[address] = now

    def forget(self, address: str) -> None:
        self.since.pop(address, None)

    def may_try(self, address: str, now: float) -> bool:
        """Whether `address` may be added now (and, if it was held, forget that)."""
        held_at = self.since.get(address)
        if held_at is not None and now - held_at < self.retry_s:
            return False
        self.forget(address)
        return True
