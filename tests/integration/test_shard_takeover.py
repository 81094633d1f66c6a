"""A worker is driven by one scheduler at a time: real scheduler processes and simulated
workers (real Worker services) show that a shard which finds a worker driven by another leaves
it alone, and takes it over once the other is gone.

Shard A has the workers by lease; shard B lists the same workers statically (as it would find
them by DNS). B must not disturb A's streams, and when A is killed, B's static source tries the
workers again and drives them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.v1 import scheduler_pb2
from tests.support.simulated_fleet import (
    SchedulerProcess,
    SimulatedFleetProcess,
    start_scheduler,
)
from tests.support.simulated_worker import StepTimeModel

pytestmark = [pytest.mark.services]

FAST_STEPS = StepTimeModel(fixed_ms=1.0, per_token_ms=0.005)
ARGS = ["--worker-lease-s", "3", "--health-interval-s", "0.5"]


def ready(scheduler: SchedulerProcess) -> set[str]:
    return {
        r.address for r in scheduler.stats().replicas if r.state == scheduler_pb2.WORKER_STATE_READY
    }


def wait(predicate, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def shard_a(tmp_path: Path) -> Iterator[tuple[SchedulerProcess, SimulatedFleetProcess, Path]]:
    scheduler = start_scheduler(tmp_path / "a.log", ARGS)
    workers = None
    try:
        workers = SimulatedFleetProcess(scheduler.address, 2, tmp_path / "workers.log", FAST_STEPS)
        scheduler.wait_ready(2)
        yield scheduler, workers, tmp_path
    finally:
        scheduler.stop()
        if workers is not None:
            workers.stop()


def test_a_shard_leaves_another_shards_workers_and_takes_them_over_when_it_is_gone(shard_a):
    a, workers, logs = shard_a
    b = start_scheduler(logs / "b.log", [*ARGS, "--workers", ",".join(workers.addresses)])
    try:
        # B tries each worker, finds A's stream open, and lets go: no replica there.
        wait(lambda: b.log.read_text().count("worker held by another scheduler") >= 2, "B tries")
        assert ready(a) == set(workers.addresses)
        assert ready(b) == set()
        a.popen.kill()
        a.popen.wait()
        # The workers' streams closed with A; B's static source tries again and drives both.
        wait(lambda: ready(b) == set(workers.addresses), "B takes the workers over")
    finally:
        b.stop()
