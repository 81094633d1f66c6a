"""Cache sizing at the handshake: the scheduler's block-count overrides replace what the
worker offers, and a cache too small for one max_model_len sequence is refused. A real
WorkerServicer (tiny random Llama) on a loopback port, and a real Replica connecting to it."""

from __future__ import annotations

import grpc
import pytest
import structlog.testing

from llmserve.v1 import worker_pb2
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet.replica import Replica, ReplicaConfig, ReplicaState
from scheduler_service.fleet.replica_events import EngineDropped, ReplicaEvent, StateChanged

from .fake_scheduler import until
from .test_server_lifecycle import Served, Stream, first_step, run


def test_initialize_cache_takes_more_blocks_than_the_worker_offers(tiny_llama):
    # The scheduler's overrides replace the offered counts (64 device, 16 host blocks).
    async def body(w: Served) -> None:
        reply = await w.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=80, num_cpu_blocks=20)
        )
        assert (reply.num_gpu_blocks, reply.num_cpu_blocks) == (80, 20)
        cache = w.worker.cache_engine
        assert (cache.num_device_blocks, cache.num_host_blocks) == (80, 20)
        assert cache.device_cache.shape[0] == 80
        stream = Stream(w.stub)
        assert len(await stream.step(first_step())) == 1
        stream.call.cancel()

    run(tiny_llama, body)


def test_a_cache_too_small_for_max_model_len_is_refused(tiny_llama):
    # max_model_len 62 on blocks of 4 tokens: one sequence needs 16 blocks (62 / 4 rounded up).
    async def body(w: Served) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=15))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(
            "num_gpu_blocks: 15 blocks of 4 tokens cannot hold one sequence of max_model_len "
            "(62 tokens, 16 blocks)"
        )
        assert w.worker.cache_engine is None
        assert (await w.stub.Info(worker_pb2.InfoRequest())).num_gpu_blocks == 0
        reply = await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=16))
        assert reply.num_gpu_blocks == 16

    run(tiny_llama, body, max_model_len=62)


class Owner:
    """A replica's `report` that records the replica's states."""

    def __init__(self) -> None:
        self.states: list[ReplicaState] = []

    def __call__(self, event: ReplicaEvent[Replica]) -> None:
        if isinstance(event, StateChanged):
            self.states.append(event.replica.state)
        elif not isinstance(event, EngineDropped):  # no move to fall back
            raise AssertionError(f"no request was placed: {event}")


def replica_config(**overrides: int) -> ReplicaConfig:
    return ReplicaConfig(SchedulerConfig(max_model_len=64), health_interval_s=60.0, **overrides)


def test_the_replica_asks_for_its_overrides_even_above_what_the_worker_offers(tiny_llama):
    # The worker offers 64 device and 16 host blocks.
    async def body(w: Served) -> None:
        owner = Owner()
        replica = Replica(
            0,
            w.address,
            replica_config(num_gpu_blocks_override=80, num_cpu_blocks_override=4),
            owner,
        )
        replica.start()
        await until(lambda: replica.state is ReplicaState.READY)
        assert replica.engine is not None
        cache = replica.engine.cache_config
        assert (cache.num_gpu_blocks, cache.num_cpu_blocks) == (80, 4)
        assert w.servicer.allocated == (80, 4)
        await replica.stop()

    run(tiny_llama, body)


def test_without_overrides_the_replica_takes_what_the_worker_offers(tiny_llama):
    async def body(w: Served) -> None:
        replica = Replica(0, w.address, replica_config(), Owner())
        replica.start()
        await until(lambda: replica.state is ReplicaState.READY)
        assert replica.engine is not None
        cache = replica.engine.cache_config
        assert (cache.num_gpu_blocks, cache.num_cpu_blocks) == (64, 16)
        await replica.stop()

    run(tiny_llama, body)


def test_a_replica_whose_cache_is_refused_never_becomes_ready(tiny_llama):
    # max_model_len 64 needs 16 blocks of 4 tokens; the override asks for 15.
    async def body(w: Served) -> None:
        owner = Owner()
        replica = Replica(0, w.address, replica_config(num_gpu_blocks_override=15), owner)
        with structlog.testing.capture_logs() as logs:
            replica.start()
            await until(lambda: owner.states)
        assert owner.states == [ReplicaState.LOST]
        # Logged as the configuration error it is, with the worker's reason.
        (refusal,) = [e for e in logs if e["event"].startswith("worker refused")]
        assert refusal["log_level"] == "error"
        assert refusal["reason"].startswith("num_gpu_blocks: 15 blocks of 4 tokens")
        assert replica.engine is None and w.servicer.allocated == (0, 0)
        await replica.stop()

    run(tiny_llama, body)
