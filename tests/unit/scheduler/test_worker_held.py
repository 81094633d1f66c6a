"""`open_worker` against a real Worker service (a simulated worker on loopback) whose Execute
stream is open: a stream that ends within HELD_WAIT_S (this scheduler's own, closed just
before) is waited out; one that stays open belongs to another scheduler."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet.fleet_config import ReplicaConfig
from scheduler_service.fleet.worker_link import HELD_WAIT_S, HeldElsewhereError, open_worker
from tests.support.simulated_fleet import serve_simulated
from tests.support.simulated_worker import SimulatedConfig

CONFIG = ReplicaConfig(SchedulerConfig(8, 256, 256, True), num_gpu_blocks_override=64)


async def with_open_stream(close_after_s: float | None) -> worker_pb2.InfoResponse:
    """open_worker while another stream holds the worker (closed after `close_after_s`)."""
    server = await serve_simulated(SimulatedConfig(num_gpu_blocks=64, max_model_len=256), None)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=64))
            holder = stub.Execute(_never())
            while not (await stub.Info(worker_pb2.InfoRequest())).execute_stream_open:
                await asyncio.sleep(0.01)
            if close_after_s is not None:
                asyncio.get_running_loop().call_later(close_after_s, holder.cancel)
            link = await open_worker(stub, CONFIG)
            holder.cancel()
            return link.info
    finally:
        await server.stop()


async def _never():  # type: ignore[no-untyped-def]
    await asyncio.Event().wait()
    yield worker_pb2.ExecuteRequest()


def test_a_stream_that_ends_soon_is_waited_out():
    info = asyncio.run(with_open_stream(close_after_s=HELD_WAIT_S / 4))
    assert not info.execute_stream_open


def test_a_stream_that_stays_open_is_another_schedulers():
    with pytest.raises(HeldElsewhereError):
        asyncio.run(with_open_stream(close_after_s=None))
