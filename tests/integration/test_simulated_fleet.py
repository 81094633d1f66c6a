"""A real scheduler process drives 4 simulated workers (one process, real Worker services that
join with leases) under memory pressure: every request ends with exactly the tokens the
simulated workers' token function gives, whatever preemption, swapping and copy-on-write did
on the way, stop token ids and max_tokens end choices where they should, and every block is
free at the end."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from llmserve.v1 import common_pb2, scheduler_pb2
from tests.support.connect_driver import ConnectDriver, Tracked
from tests.support.simulated_fleet import (
    SchedulerProcess,
    SimulatedFleetProcess,
    start_scheduler,
)
from tests.support.simulated_worker import StepTimeModel, expected_tokens

pytestmark = [pytest.mark.services]

NUM_WORKERS = 4
# 24 blocks of 16 tokens per worker for about 12 requests of up to 88 tokens each: the
# scheduler preempts (recompute for single sequences, swap for n = 2) to get through.
SCHEDULER_ARGS = [
    "--worker-lease-s", "3", "--health-interval-s", "0.5", "--max-num-seqs", "16",
    "--num-gpu-blocks-override", "24", "--num-cpu-blocks-override", "64",
]  # fmt: skip
WORKER_ARGS = ["--max-model-len", "256"]
FAST_STEPS = StepTimeModel(fixed_ms=1.0, per_token_ms=0.005)
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SchedulerProcess, SimulatedFleetProcess]]:
    logs = tmp_path_factory.mktemp("simulated-fleet")
    scheduler = start_scheduler(logs / "scheduler.log", SCHEDULER_ARGS)
    workers = None
    try:
        workers = SimulatedFleetProcess(
            scheduler.address, NUM_WORKERS, logs / "workers.log", FAST_STEPS, WORKER_ARGS
        )
        scheduler.wait_ready(NUM_WORKERS)
        yield scheduler, workers
    finally:
        scheduler.stop()
        if workers is not None:
            workers.stop()


def workload(count: int) -> list[tuple[str, list[int], dict]]:  # type: ignore[type-arg]
    """Greedy requests; every fourth with n = 2; every fifth stops at a token it will sample."""
    rng = random.Random(7)
    out = []
    for i in range(count):
        prompt = [rng.randrange(1, 50000) for _ in range(rng.randrange(8, 40))]
        params: dict = {"max_tokens": rng.randrange(16, 48), "ignore_eos": True}  # type: ignore[type-arg]
        if i % 4 == 1:
            params.update(n=2, temperature=0.8, seed=i)
        elif i % 5 == 0:
            stop_at = rng.randrange(2, params["max_tokens"] - 4)
            params["stop_token_ids"] = [expected_tokens(prompt, stop_at + 1)[stop_at]]
        out.append((f"sim-{i}", prompt, params))
    return out


async def serve(address: str, requests: list[tuple[str, list[int], dict]]) -> dict[str, Tracked]:  # type: ignore[type-arg]
    async with ConnectDriver(address) as driver:
        for request_id, prompt, params in requests:
            driver.submit(request_id, prompt, **params)
        await driver.wait_all(timeout_s=120)
        return driver.requests


def expected_choice(prompt: list[int], params: dict, seq_index: int) -> tuple[list[int], int]:  # type: ignore[type-arg]
    """The tokens and finish reason of one choice."""
    tokens = expected_tokens(prompt, params["max_tokens"], seq_index)
    for stop in params.get("stop_token_ids", ()):
        if stop in tokens:
            return tokens[: tokens.index(stop) + 1], STOP
    return tokens, LENGTH


def test_simulated_workers_serve_exact_tokens_and_free_every_block(
    fleet: tuple[SchedulerProcess, SimulatedFleetProcess],
) -> None:
    scheduler, workers = fleet
    requests = workload(48)
    received = asyncio.run(serve(scheduler.address, requests))

    for request_id, prompt, params in requests:
        got = received[request_id]
        assert got.error is None, (request_id, got.error)
        n = params.get("n", 1)
        want = [expected_choice(prompt, params, i) for i in range(n)]
        choices = [(got.token_ids[i], got.finish_reasons[i]) for i in range(n)]
        # Which sampled sequence becomes which choice is the scheduler's business.
        assert sorted(choices) == sorted(want), request_id
        if "stop_token_ids" in params:
            assert got.stop_token_ids == {0: params["stop_token_ids"][0]}, request_id

    stats = scheduler.stats()
    assert stats.num_unfinished_requests == 0
    ready = [r for r in stats.replicas if r.state == scheduler_pb2.WORKER_STATE_READY]
    assert len(ready) == NUM_WORKERS
    for r in ready:
        assert (r.gpu_blocks_free, r.cpu_blocks_free) == (r.gpu_blocks_total, r.cpu_blocks_total)
    assert stats.totals.num_preemptions > 0  # the memory pressure was real
    pooled = workers.stats()
    assert pooled["workers"] == NUM_WORKERS
    assert pooled["copied_blocks"] > 0  # n = 2 forks share a partial last block: copy-on-write
    sampled = sum(len(t) for r in received.values() for t in r.token_ids.values())
    assert pooled["tokens_sampled"] >= sampled  # beyond it: tokens recomputed after preemption


STREAM_INTERVAL = 4


def test_a_stream_interval_gathers_tokens_and_changes_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--stream-interval 4`: the same exact tokens and finish reasons, in at most one message
    for the first token and one per 4 after it."""
    scheduler = start_scheduler(
        tmp_path / "scheduler.log", [*SCHEDULER_ARGS, "--stream-interval", str(STREAM_INTERVAL)]
    )
    workers = None
    try:
        workers = SimulatedFleetProcess(
            scheduler.address, 1, tmp_path / "workers.log", FAST_STEPS, WORKER_ARGS
        )
        scheduler.wait_ready(1)
        requests = workload(12)
        received = asyncio.run(serve(scheduler.address, requests))
    finally:
        scheduler.stop()
        if workers is not None:
            workers.stop()
    for request_id, prompt, params in requests:
        got = received[request_id]
        assert got.error is None, (request_id, got.error)
        want = [expected_choice(prompt, params, i) for i in range(params.get("n", 1))]
        choices = [(got.token_ids[i], got.finish_reasons[i]) for i in range(len(want))]
        assert sorted(choices) == sorted(want), request_id
        longest = max(len(tokens) for tokens, _ in want)
        assert got.num_outputs <= 1 + -(-(longest - 1) // STREAM_INTERVAL), request_id
