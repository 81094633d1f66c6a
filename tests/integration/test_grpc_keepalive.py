"""Long-lived streams between our services survive idle minutes under keepalive pings.

The scheduler's Execute stream to each worker and the gateway's Connect stream to the scheduler
stay open while no request runs. Our clients ping every 30 s; a server with gRPC's default
policy answers the third ping without data with GOAWAY "too_many_pings", about 150 s after
the last message, and the next request then met a dead stream. This runs the production
options against a control server that keeps gRPC's defaults, side by side, over real loopback
connections: a few minutes of idle time, with no way to shorten it (scaled-down intervals do
not trip gRPC's throttled pings).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from llmserve.grpc_utils import channel_options, server_options

pytestmark = pytest.mark.slow

IDLE_S = 175.0
_METHOD = "/llmserve.test.Echo/Chat"


async def _echo(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


async def _start(options: list[tuple[str, object]]) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "llmserve.test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _idle_stream_survives(server_opts: list[tuple[str, object]]) -> bool:
    server, port = await _start(server_opts)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    try:
        call = channel.stream_stream(_METHOD)()
        for i in range(10):  # some traffic first, as a served request leaves it
            await call.write(b"request %d" % i)
            assert await call.read() == b"request %d" % i
        await asyncio.sleep(IDLE_S)
        try:
            await call.write(b"after idle")
            return await asyncio.wait_for(call.read(), 10) == b"after idle"
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False
    finally:
        await channel.close()
        await server.stop(None)


def test_idle_streams_survive_keepalive_pings():
    async def both() -> tuple[bool, bool]:
        control = channel_options()  # what the servers used before: no ping policy
        return tuple(  # type: ignore[return-value]
            await asyncio.gather(
                _idle_stream_survives(server_options()), _idle_stream_survives(control)
            )
        )

    ours, control = asyncio.run(both())
    assert ours, "the stream to a server with our options died while idle"
    assert not control, "the control server kept the stream: the test no longer shows the bug"
