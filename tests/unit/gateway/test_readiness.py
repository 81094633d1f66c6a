"""The gateway's readiness follows the scheduler's gRPC health, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.readiness import SCHEDULER_SERVICE, SchedulerReadiness
from llmserve.grpc_utils import create_server, set_serving
from llmserve.ports import free_port
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_ready_only_while_connected_and_the_scheduler_serves():
    async def main() -> None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        connected = {"value": True}
        changes: list[bool] = []
        readiness = SchedulerReadiness(
            address,
            lambda: connected["value"],
            retry_s=0.1,
            on_change=lambda: changes.append(readiness.scheduler_serving),
        )
        readiness.start()
        try:
            # Nothing listens yet.
            await asyncio.sleep(0.3)
            assert readiness.not_ready_reason() == "no ready worker"

            server, health = create_server([SCHEDULER_SERVICE])
            server.add_insecure_port(address)
            await set_serving(health, [SCHEDULER_SERVICE], False)
            await server.start()
            await asyncio.sleep(0.3)
            assert readiness.not_ready_reason() == "no ready worker"

            await set_serving(health, [SCHEDULER_SERVICE], True)  # a worker became ready
            await wait_for(lambda: readiness.ready)

            connected["value"] = False  # the Connect stream broke
            assert readiness.not_ready_reason() == "scheduler unavailable"
            connected["value"] = True
            assert readiness.ready

            await server.stop(grace=None)  # the scheduler went away
            await wait_for(lambda: not readiness.ready)
            assert readiness.not_ready_reason() == "no ready worker"

            server, health = create_server([SCHEDULER_SERVICE])
            server.add_insecure_port(address)
            await set_serving(health, [SCHEDULER_SERVICE], True)
            await server.start()
            await wait_for(lambda: readiness.ready)  # the watch is re-opened

            readiness.drain()
            assert readiness.not_ready_reason() == "draining"
            await server.stop(grace=None)
            await wait_for(lambda: len(changes) == 4)
            # Each change of the scheduler's health was heard once, in order (the gateway
            # moves requests off a shard that stopped serving).
            assert changes == [True, False, True, False]
        finally:
            await readiness.close()

    asyncio.run(main())


class _Stats(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.max_model_len = 0

    async def GetStats(self, request, context):  # type: ignore[no-untyped-def]
        return scheduler_pb2.GetStatsResponse(max_model_len=self.max_model_len)


def test_max_model_len_is_learned_from_the_scheduler_when_it_serves():
    """The gateway never decides max_model_len: it asks the scheduler each time the scheduler
    turns SERVING, and is ready only once it knows it."""

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        learned: list[int] = []
        readiness = SchedulerReadiness(
            address, lambda: True, retry_s=0.1, on_max_model_len=learned.append
        )
        stats = _Stats()
        server, health = create_server([SCHEDULER_SERVICE])
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(stats, server)
        server.add_insecure_port(address)
        await set_serving(health, [SCHEDULER_SERVICE], False)
        await server.start()
        readiness.start()
        try:
            stats.max_model_len = 96
            await set_serving(health, [SCHEDULER_SERVICE], True)
            await wait_for(lambda: readiness.ready)
            assert learned == [96]

            # The worker went and another came, with a shorter context.
            await set_serving(health, [SCHEDULER_SERVICE], False)
            await wait_for(lambda: not readiness.ready)
            stats.max_model_len = 48
            await set_serving(health, [SCHEDULER_SERVICE], True)
            await wait_for(lambda: readiness.ready)
            assert learned == [96, 48]
        finally:
            await readiness.close()
            await server.stop(grace=None)

    asyncio.run(main())
