"""The scheduler's batch limits at InitializeCache: the worker adopts them (and offers the
blocks that fit under them), keeps its own when none are sent, and refuses, by name, limits
that its own flags set otherwise. A real WorkerServicer (tiny random Llama, CPU) on a loopback
port; the scheduler's side is a real Replica."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog.testing

from llmserve.batch_limits import BatchLimits
from llmserve.v1 import worker_pb2
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet.replica import Replica, ReplicaConfig, ReplicaState

from .fake_scheduler import until
from .test_cache_sizing import Owner
from .test_server_lifecycle import Served, Stream, first_step, served_worker

KV_MEMORY = 1 << 20  # CPU: the blocks that fit are this many bytes' worth


def run(tiny_llama: tuple[Path, Any], body: Callable[[Served], Awaitable[None]], **config: Any):
    async def main() -> None:
        async with served_worker(
            tiny_llama[0], kv_cache_memory_bytes=KV_MEMORY, swap_space_bytes=0, **config
        ) as served:
            await body(served)

    asyncio.run(main())


def adopted(logs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [
        (e["max_num_seqs"], e["max_num_batched_tokens"])
        for e in logs
        if e["event"] == "batch limits adopted"
    ]


def test_the_worker_adopts_the_limits_sent_and_allocates_what_fits_under_them(tiny_llama):
    async def body(w: Served) -> None:
        fits = KV_MEMORY // w.worker.get_cache_block_size_bytes()
        assert w.servicer.num_gpu_blocks_available == 64  # what served_worker offers
        with structlog.testing.capture_logs() as logs:
            reply = await w.stub.InitializeCache(
                worker_pb2.InitializeCacheRequest(max_num_seqs=8, max_num_batched_tokens=64)
            )
        assert w.worker.batch_limits == BatchLimits(8, 64)
        assert adopted(logs) == [(8, 64)]
        # Other limits than its own: the worker profiled again, and offers what fits now.
        (capacity,) = [e for e in logs if e["event"] == "kv capacity"]
        assert (capacity["num_gpu_blocks"], capacity["max_num_seqs"]) == (fits, 8)
        assert (reply.num_gpu_blocks, reply.num_cpu_blocks) == (fits, 0)
        assert w.worker.cache_engine.num_device_blocks == fits
        info = await w.stub.Info(worker_pb2.InfoRequest())
        assert (info.num_gpu_blocks_available, info.num_gpu_blocks) == (fits, fits)
        stream = Stream(w.stub)
        assert len(await stream.step(first_step())) == 1
        stream.call.cancel()

    run(tiny_llama, body)


def test_the_same_limits_again_keep_the_cache(tiny_llama):
    async def body(w: Served) -> None:
        request = worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, max_num_seqs=8)
        await w.stub.InitializeCache(request)
        cache = w.worker.cache_engine
        with structlog.testing.capture_logs() as logs:
            await w.stub.InitializeCache(request)
        assert w.worker.cache_engine is cache
        assert adopted(logs) == [(8, 2048)]
        assert [e for e in logs if e["event"] == "kv capacity"] == []

    run(tiny_llama, body)


def test_without_limits_sent_the_worker_keeps_its_own(tiny_llama):
    async def body(w: Served) -> None:
        with structlog.testing.capture_logs() as logs:
            await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        assert w.worker.batch_limits == BatchLimits(256, 512)
        assert adopted(logs) == [(256, 512)]
        assert w.servicer.num_gpu_blocks_available == 64  # not profiled again

    run(tiny_llama, body, max_num_batched_tokens=512)


def test_limits_other_than_the_workers_flags_are_refused_by_name(tiny_llama):
    async def body(w: Served) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.stub.InitializeCache(
                worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, max_num_seqs=8)
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "max_num_seqs: the scheduler sends 8, but this worker was started with "
            "--max-num-seqs 16; start the worker without --max-num-seqs (it follows the "
            "scheduler) or give both the same value"
        )
        assert w.worker.cache_engine is None
        assert w.worker.batch_limits == BatchLimits(16, 2048)
        await w.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, max_num_seqs=16)
        )
        assert w.servicer.allocated == (32, 0)

    run(tiny_llama, body, max_num_seqs=16)


def test_limits_cannot_change_under_an_open_stream(tiny_llama):
    async def body(w: Served) -> None:
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        stream = Stream(w.stub)
        await stream.step(first_step())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.stub.InitializeCache(
                worker_pb2.InitializeCacheRequest(num_gpu_blocks=32, max_num_seqs=8)
            )
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert refused.value.details().startswith("cannot change the batch limits")
        assert w.worker.batch_limits == BatchLimits()
        assert w.worker.num_sequences == 1
        stream.call.cancel()

    run(tiny_llama, body)


def test_the_profile_run_is_the_largest_step_under_the_adopted_limits(tiny_llama):
    # On CPU the profile run decides nothing; its shape is what a CUDA worker would measure.
    async def body(w: Served) -> None:
        worker = w.worker
        steps: list[list[int]] = []
        runner_run = worker.runner.run

        def run_step(scheduled, *args):  # type: ignore[no-untyped-def]
            steps.append([s.count for s in scheduled])
            return runner_run(scheduled, *args)

        worker.runner.run = run_step  # type: ignore[method-assign]
        await w.on_model_thread(lambda: worker.use_batch_limits(BatchLimits(4, 32)))
        await w.on_model_thread(worker._profile_run)
        assert steps == [[8, 8, 8, 8]]

    run(tiny_llama, body)


def replica_config(**scheduler: int) -> ReplicaConfig:
    return ReplicaConfig(SchedulerConfig(max_model_len=64, **scheduler), health_interval_s=60.0)


def test_a_replica_sends_its_limits(tiny_llama):
    async def body(w: Served) -> None:
        replica = Replica(0, w.address, replica_config(max_num_seqs=8), Owner())
        replica.start()
        await until(lambda: replica.state is ReplicaState.READY)
        assert w.worker.batch_limits == BatchLimits(8, 2048)
        fits = KV_MEMORY // w.worker.get_cache_block_size_bytes()
        assert replica.engine is not None
        assert replica.engine.cache_config.num_gpu_blocks == fits
        await replica.stop()

    run(tiny_llama, body)


def test_a_replica_whose_limits_the_worker_refuses_says_why(tiny_llama):
    async def body(w: Served) -> None:
        owner = Owner()
        replica = Replica(0, w.address, replica_config(max_num_seqs=8), owner)
        with structlog.testing.capture_logs() as logs:
            replica.start()
            await until(lambda: owner.states)
        assert owner.states == [ReplicaState.LOST]
        (refusal,) = [e for e in logs if e["event"].startswith("worker refused")]
        assert refusal["log_level"] == "error"
        assert refusal["reason"].startswith(
            "max_num_seqs: the scheduler sends 8, but this worker was started with "
            "--max-num-seqs 16"
        )
        assert w.servicer.allocated == (0, 0)
        await replica.stop()

    run(tiny_llama, body, max_num_seqs=16)
