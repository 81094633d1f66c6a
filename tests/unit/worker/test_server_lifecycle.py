"""The Worker service across a scheduler's restart and through a drain: a real WorkerServicer
over a tiny random Llama, served by a real in-process gRPC server on a loopback port."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.grpc_utils import create_server, set_serving
from llmserve.ports import free_port
from llmserve.security import AuthInterceptor, KeySet, aio_bearer
from llmserve.step_proto import step_input_to_proto, step_result_from_proto
from llmserve.steps import CachedSequence, StepInput
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.config import WorkerConfig
from worker_service.membership import LeaseKeeper, WorkerDrain
from worker_service.server import WorkerServicer
from worker_service.worker import Worker

from .factories import BLOCK_SIZE, new_seq
from .fake_scheduler import FakeScheduler, serve, until

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
PROMPT = [5, 17, 33, 2, 9, 41]


@dataclass
class Served:
    address: str
    server: grpc.aio.Server
    health: object
    servicer: WorkerServicer
    worker: Worker
    model_thread: ThreadPoolExecutor
    stub: worker_pb2_grpc.WorkerStub

    async def on_model_thread(self, fn: Callable[[], object]) -> object:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn)


@asynccontextmanager
async def served_worker(
    model_dir: Path,
    max_model_len: int = 64,
    mask_wait_timeout_s: float = 30.0,
    internal_token: str | None = None,
    **config: Any,
) -> AsyncIterator[Served]:
    """A worker offering 64 device and 16 host blocks; caches from max_model_len / BLOCK_SIZE
    blocks up are accepted. With `internal_token`, its Worker RPCs require that token (the
    stub sends it). `config`: more WorkerConfig fields."""
    model_thread = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    config = WorkerConfig(
        model=str(model_dir),
        block_size=BLOCK_SIZE,
        num_threads=1,
        max_model_len=max_model_len,
        mask_wait_timeout_s=mask_wait_timeout_s,
        **config,
    )
    worker = await loop.run_in_executor(model_thread, Worker, config)
    await loop.run_in_executor(model_thread, worker.load_model)
    servicer = WorkerServicer(worker, 64, 16, model_thread)
    guard, bearer = [], []
    if internal_token is not None:
        guard = [AuthInterceptor(KeySet([internal_token]), [SERVICE], "internal token")]
        bearer = aio_bearer(internal_token)
    server, health = create_server([SERVICE], interceptors=guard)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    await set_serving(health, [SERVICE])
    try:
        async with grpc.aio.insecure_channel(address, interceptors=bearer) as channel:
            yield Served(
                address,
                server,
                health,
                servicer,
                worker,
                model_thread,
                worker_pb2_grpc.WorkerStub(channel),
            )
    finally:
        await server.stop(0)
        model_thread.shutdown()


class Stream:
    """One Execute stream, driven a step at a time."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.outbox: asyncio.Queue[worker_pb2.ExecuteRequest | None] = asyncio.Queue()
        self.call = stub.Execute(self._requests())

    async def _requests(self) -> AsyncIterator[worker_pb2.ExecuteRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def step(self, step: StepInput) -> dict[int, int]:
        await self.outbox.put(step_input_to_proto(step))
        result = step_result_from_proto(await self.call.read())
        return {o.seq_id: o.samples[0].token_id for o in result.outputs}


def first_step(seq_id: int = 1) -> StepInput:
    return StepInput(0, new_seqs=[new_seq(seq_id, PROMPT, [0, 1])])


async def holding_one_sequence(w: Served) -> Stream:
    """A worker with a cache, and a stream on which it holds one sequence (a first step)."""
    await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
    stream = Stream(w.stub)
    await stream.step(first_step())
    return stream


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
    return reply.status


def run(
    tiny_llama: tuple[Path, object],
    body: Callable[[Served], Awaitable[None]],
    max_model_len: int = 64,
    mask_wait_timeout_s: float = 30.0,
) -> None:
    async def main() -> None:
        async with served_worker(tiny_llama[0], max_model_len, mask_wait_timeout_s) as served:
            await body(served)

    asyncio.run(main())


def test_a_restarted_scheduler_re_initializes_the_worker_and_starts_over(tiny_llama):
    async def body(w: Served) -> None:
        assert (await w.stub.Info(worker_pb2.InfoRequest())).num_gpu_blocks == 0
        await w.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, num_cpu_blocks=8)
        )
        cache = w.worker.cache_engine
        old = Stream(w.stub)
        first_token = (await old.step(first_step()))[1]
        assert w.worker.num_sequences == 1
        # The stream holds the worker: Info says so, and another scheduler (shard) can neither
        # replace the cache with a different size nor open a second stream.
        assert (await w.stub.Info(worker_pb2.InfoRequest())).execute_stream_open
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=24))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.aio.AioRpcError) as second:
            await Stream(w.stub).step(first_step(seq_id=9))
        assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert w.worker.num_sequences == 1

        closed: list[bool] = []  # the lease keeper's hook (worker_service.membership.keep_lease)
        w.servicer.on_stream_closed = lambda: closed.append(w.servicer.stream_open)
        old.call.cancel()  # the scheduler process dies: its stream breaks
        await until(lambda: not w.servicer.stream_open)
        assert closed == [False]  # called once, with the stream already counted as closed
        assert not (await w.stub.Info(worker_pb2.InfoRequest())).execute_stream_open
        assert await w.on_model_thread(lambda: w.worker.num_sequences) == 0

        # The restarted scheduler runs the handshake again: same sizes keep the cache.
        info = await w.stub.Info(worker_pb2.InfoRequest())
        assert (info.num_gpu_blocks, info.num_cpu_blocks) == (32, 8)
        reply = await w.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, num_cpu_blocks=8)
        )
        assert (reply.num_gpu_blocks, reply.num_cpu_blocks) == (32, 8)
        assert w.worker.cache_engine is cache
        new = Stream(w.stub)
        # The old stream's sequence is gone: an update for it is a protocol error ...
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await new.step(StepInput(1, cached_seqs=[_decode(1, first_token)]))
        assert unknown.value.code() == grpc.StatusCode.INTERNAL
        assert "no state for seq 1" in unknown.value.details()
        await until(lambda: not w.servicer.stream_open)
        # ... and resent as new it computes the same token as before.
        again = Stream(w.stub)
        assert (await again.step(first_step()))[1] == first_token
        again.call.cancel()
        await until(lambda: not w.servicer.stream_open)

        # Other sizes reallocate (and still compute the same token).
        await w.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=24, num_cpu_blocks=4)
        )
        assert w.worker.cache_engine is not cache
        info = await w.stub.Info(worker_pb2.InfoRequest())
        assert (info.num_gpu_blocks, info.num_cpu_blocks) == (24, 4)
        assert await w.on_model_thread(lambda: w.worker.num_sequences) == 0
        last = Stream(w.stub)
        assert (await last.step(first_step(seq_id=7)))[7] == first_token
        last.call.cancel()

    run(tiny_llama, body)


def _decode(seq_id: int, token: int) -> CachedSequence:
    """A decode update for a sequence of PROMPT holding blocks [0, 1]."""
    return CachedSequence(seq_id, [token], 2, [], 1)


def test_drain_with_a_scheduler_waits_for_the_stream_to_end(tiny_llama):
    async def body(w: Served) -> None:
        port = free_port()
        fake = FakeScheduler(replica_id=3, lease_ms=3000)
        scheduler = await serve(fake, port)
        keeper = LeaseKeeper(f"127.0.0.1:{port}", w.address)
        lease_task = asyncio.create_task(keeper.run())
        await until(lambda: keeper.registrations >= 1)
        stream = await holding_one_sequence(w)
        drain = WorkerDrain(
            w.server,
            w.health,
            w.servicer,
            timeout_s=120,
            scheduler=f"127.0.0.1:{port}",
            advertised=w.address,
            lease_task=lease_task,
            quiet_s=0.0,
        )
        draining = asyncio.create_task(drain.run())
        await until(lambda: fake.drained == [w.address])
        assert await health_status(w.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert lease_task.done()
        renewals = len(fake.registered)
        # The scheduler still has a sequence here: the drain waits, even with quiet_s 0.
        assert not draining.done()
        await stream.step(StepInput(1, freed_seq_ids=[1]))  # the scheduler moved it away ...
        stream.call.cancel()  # ... and dropped the replica, closing its stream
        await draining
        await scheduler.stop(0)
        assert drain.exit_code == 0
        assert len(fake.registered) == renewals  # no renewal after the drain began

    run(tiny_llama, body)


def test_drain_of_a_static_worker_ends_when_idle_and_refuses_new_streams(tiny_llama):
    async def body(w: Served) -> None:
        stream = await holding_one_sequence(w)
        drain = WorkerDrain(w.server, w.health, w.servicer, timeout_s=120, quiet_s=0.2)
        draining = asyncio.create_task(drain.run())
        await until(lambda: w.servicer.draining)
        # The scheduler finishes the request; then no step comes: the worker is idle.
        await stream.step(StepInput(1, freed_seq_ids=[1]))
        await draining
        assert drain.exit_code == 0

    run(tiny_llama, body)


def test_a_draining_worker_refuses_a_new_execute_stream(tiny_llama):
    async def body(w: Served) -> None:
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        w.servicer.start_draining()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await Stream(w.stub).step(first_step())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()

    run(tiny_llama, body)


def test_drain_times_out_with_a_sequence_still_held(tiny_llama):
    async def body(w: Served) -> None:
        _held = await holding_one_sequence(w)  # open while the drain runs
        drain = WorkerDrain(w.server, w.health, w.servicer, timeout_s=0.5, quiet_s=0.0)
        await drain.run()
        assert drain.exit_code == 1
        with pytest.raises(grpc.aio.AioRpcError):  # the server was stopped
            await w.stub.Info(worker_pb2.InfoRequest(), timeout=5)

    run(tiny_llama, body)


def test_a_second_signal_cuts_the_drain_short(tiny_llama):
    async def body(w: Served) -> None:
        _held = await holding_one_sequence(w)  # open while the drain runs
        drain = WorkerDrain(w.server, w.health, w.servicer, timeout_s=120, quiet_s=0.0)
        draining = asyncio.create_task(drain.run())
        await until(lambda: w.servicer.draining)  # its signal handlers are installed by now
        os.kill(os.getpid(), signal.SIGTERM)
        await draining
        assert drain.exit_code == 1

    run(tiny_llama, body)
