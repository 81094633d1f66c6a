"""The scenario of test_grpc_keepalive.py, run as `python -m tests.integration.keepalive_scenario`
in the background from the session's start (tests/support/background.py): it prints one JSON
line, {"ours_alive": bool, "control_lasted": seconds or null}.

Two echo servers on loopback, one with our server options and a control with gRPC's defaults
(what our servers had before), each with one stream from a client with our channel options.
After some traffic both streams go idle; the control's is watched until its server closes it
(GOAWAY "too_many_pings"), and ours stays idle past that point by one more ping, then must
still echo.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc

from llmserve.grpc_utils import channel_options, server_options

# The control's stream closed 150 s into idleness in most trials and 210 s in one (the server
# counts pings it finds too frequent, and the timers of the two sides drift against each
# other), so the scenario waits for it to close rather than for a fixed time.
CONTROL_LIMIT_S = 330.0
# Ours stays idle this much longer than the control's stream lasted: past one more ping.
PING_MARGIN_S = 35.0
# The most the whole scenario can take, with time to open and close the streams.
TOTAL_LIMIT_S = CONTROL_LIMIT_S + PING_MARGIN_S + 60.0
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


async def _open_stream(
    server_opts: list[tuple[str, object]],
) -> tuple[grpc.aio.Server, grpc.aio.Channel, grpc.aio.StreamStreamCall]:
    server, port = await _start(server_opts)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    call = channel.stream_stream(_METHOD)()
    for i in range(10):  # some traffic first, as a served request leaves it
        await call.write(b"request %d" % i)
        assert await call.read() == b"request %d" % i
    return server, channel, call


async def _seconds_until_closed(call: grpc.aio.StreamStreamCall, limit_s: float) -> float | None:
    """How long the idle stream lasted before the server closed it; None: open after limit_s."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(call.read(), limit_s)
    except grpc.aio.AioRpcError:
        return time.monotonic() - started
    except TimeoutError:
        return None
    return None  # the echo server never sends unasked


async def _still_echoes(call: grpc.aio.StreamStreamCall) -> bool:
    try:
        await call.write(b"after idle")
        return await asyncio.wait_for(call.read(), 10) == b"after idle"
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False


async def run() -> dict[str, object]:
    ours = await _open_stream(server_options())
    control = await _open_stream(channel_options())  # what servers used before: no ping policy
    try:
        started = time.monotonic()
        control_lasted = await _seconds_until_closed(control[2], CONTROL_LIMIT_S)
        idle_s = (control_lasted or CONTROL_LIMIT_S) + PING_MARGIN_S
        await asyncio.sleep(max(0.0, started + idle_s - time.monotonic()))
        return {"ours_alive": await _still_echoes(ours[2]), "control_lasted": control_lasted}
    finally:
        for server, channel, _ in (ours, control):
            await channel.close()
            await server.stop(None)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run())), flush=True)
