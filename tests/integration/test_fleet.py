"""The elastic fleet with real processes: workers die, drain and join, the scheduler restarts,
a replica's step fails, and no client sees an error or a different token.

One stack (3 workers that register with leases, a scheduler, a gateway) runs the same mixed
workload undisturbed first; every later run must equal it.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.test_kv_migration import WORKER_BLOCK_SIZE, long_workload
from tests.support.fleet import (
    FleetStack,
    Received,
    assert_same_outputs,
    mixed_workload,
    run_workload,
    start_fleet,
)
from tests.support.models import SERVICE_WINDOW


def http_workload(count: int, seed: int = 0) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """`count` streaming /v1/completions bodies with token-id prompts: greedy, seeded
    sampling and n=2."""
    rng = random.Random(seed)
    bodies: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    for i in range(count):
        body: dict = {  # type: ignore[type-arg]
            "prompt": [rng.randrange(100, 20000) for _ in range(rng.randrange(8, 24))],
            "max_tokens": rng.randrange(16, 32),
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0 if i % 3 == 0 else 0.8,
            "seed": 5000 + i,
        }
        if i % 3 == 2:
            body["n"] = 2
        bodies.append((f"http-{i}", body))
    return bodies


async def run_http_workload(
    http_port: int,
    bodies: list[tuple[str, dict]],  # type: ignore[type-arg]
) -> dict[str, dict[int, tuple[str, str | None]]]:
    """Stream every body at once through the gateway's OpenAI API; per request and choice
    index, the text received and the finish reason."""
    received: dict[str, dict[int, tuple[str, str | None]]] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=300) as client:

        async def one(request_id: str, body: dict) -> None:  # type: ignore[type-arg]
            texts: dict[int, str] = {}
            reasons: dict[int, str | None] = {}
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        index = choice["index"]
                        texts[index] = texts.get(index, "") + choice["text"]
                        reasons[index] = choice.get("finish_reason") or reasons.get(index)
            received[request_id] = {i: (texts[i], reasons.get(i)) for i in texts}

        await asyncio.gather(*(one(rid, body) for rid, body in bodies))
    return received


pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

WORKLOAD = mixed_workload(64)
HTTP_WORKLOAD = http_workload(12)
READY = scheduler_pb2.WORKER_STATE_READY


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start_fleet(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("fleet-logs"),
        3,
        scheduler_args=["--max-num-seqs", "32"],
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def baseline(fleet: FleetStack) -> dict[str, Received]:
    received = asyncio.run(run_workload(fleet.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    fleet.assert_no_leak()
    return received


async def run_with_fault_async(
    fleet: FleetStack, fault, at_chunk: int = 150, workload=WORKLOAD
) -> dict[str, Received]:  # type: ignore[no-untyped-def]
    """The workload, with `fault()` called once `at_chunk` tokens have arrived."""
    fired = []

    def on_chunk(total: int) -> None:
        if total >= at_chunk and not fired:
            fired.append(total)
            fault()

    received = await run_workload(fleet.gateway.address, workload, on_chunk)  # type: ignore[union-attr]
    assert fired, "the workload ended before the fault was injected"
    return received


def run_with_fault(
    fleet: FleetStack, fault, at_chunk: int = 150, workload=WORKLOAD
) -> dict[str, Received]:  # type: ignore[no-untyped-def]
    return asyncio.run(run_with_fault_async(fleet, fault, at_chunk, workload))


LOSS_CAUSES = ("stream", "health", "lease", "watchdog")


def llmserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True, timeout=60
    )


def migrations(fleet: FleetStack, causes: tuple[str, ...]) -> int:
    """Requests the scheduler has moved for one of `causes` (from its log: a lost replica
    leaves GetStats, with its counters, once its lease lapses)."""
    log = fleet.scheduler.log.read_text(errors="replace")  # type: ignore[union-attr]
    return sum(
        1
        for line in log.splitlines()
        if '"event": "request migrated"' in line
        and any(f'"cause": "{cause}"' in line for cause in causes)
    )


def test_worker_kill_loses_nothing(fleet: FleetStack, baseline: dict[str, Received]):
    before = migrations(fleet, LOSS_CAUSES)
    totals_before = fleet.stats().totals
    victim = fleet.workers[0]
    received = run_with_fault(fleet, victim.kill)
    assert_same_outputs(baseline, received)
    moved = migrations(fleet, LOSS_CAUSES) - before
    assert moved > 0, "the kill moved no request: it came too late"
    # Fleet-wide totals keep the lost replica's counters, whether or not it has left yet.
    totals = fleet.stats().totals
    assert totals.num_migrated_out - totals_before.num_migrated_out >= moved
    assert totals.num_steps > totals_before.num_steps
    fleet.assert_no_leak()
    # The killed worker comes back at the same address and takes requests again.
    victim.start()
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 3, "the restarted worker ready")


def test_drain_loses_nothing(fleet: FleetStack, baseline: dict[str, Received]):
    target = fleet.workers[1].address

    def drain() -> None:  # as an operator would: `llmserve drain WORKER`
        done = llmserve("drain", target, "--scheduler", fleet.scheduler.address)  # type: ignore[union-attr]
        assert done.returncode == 0, done.stderr
        requests_on_it = int(done.stdout.split("replica ")[1].split(", ")[1].split()[0])
        assert requests_on_it > 0, done.stdout

    received = run_with_fault(fleet, drain)
    assert_same_outputs(baseline, received)
    stats = fleet.wait_for(
        lambda s: target not in {r.address for r in s.replicas}, "the drained replica to leave"
    )
    assert len(fleet.ready_replicas(stats)) == 2
    # The drained replica ran steps (it had requests) and has left GetStats' replicas: the
    # fleet-wide totals still count them.
    assert stats.totals.num_steps > sum(r.num_steps for r in stats.replicas)
    fleet.assert_no_leak()
    # A drained worker that keeps running cannot slip back in by renewing its lease.
    with (
        grpc.insecure_channel(fleet.scheduler.address) as channel,  # type: ignore[union-attr]
        pytest.raises(grpc.RpcError) as info,
    ):
        scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(address=target), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A worker the scheduler does not know: one line naming the problem, exit status 1.
    unknown = llmserve("drain", "127.0.0.1:9", "--scheduler", fleet.scheduler.address)  # type: ignore[union-attr]
    assert unknown.returncode == 1
    assert unknown.stderr.strip().startswith("llmserve drain: NOT_FOUND: address: no worker")


def test_worker_joins_mid_run_and_takes_requests(fleet: FleetStack, baseline):  # type: ignore[no-untyped-def]
    joined: list[str] = []
    received = run_with_fault(
        fleet, lambda: joined.append(fleet.add_worker(wait=False).address), at_chunk=50
    )
    assert_same_outputs(baseline, received)
    fleet.wait_for(
        lambda s: any(r.address == joined[0] and r.state == READY for r in s.replicas),
        "the new worker ready",
    )
    # New requests reach it (round robin over a cold cache would too; cache_aware sends a
    # prompt with no cached prefix to the least loaded replica, and the new one is idle).
    asyncio.run(run_workload(fleet.gateway.address, mixed_workload(16, seed=7)))  # type: ignore[union-attr]
    stats = fleet.stats()
    newcomer = next(r for r in stats.replicas if r.address == joined[0])
    assert newcomer.num_steps > 0
    fleet.assert_no_leak()


def test_scheduler_restart_loses_nothing(fleet: FleetStack, baseline: dict[str, Received]):
    scheduler = fleet.scheduler
    assert scheduler is not None
    http_undisturbed = asyncio.run(run_http_workload(fleet.http_port, HTTP_WORKLOAD))

    def restart() -> None:
        scheduler.kill()
        scheduler.start(wait=False)

    async def grpc_and_http() -> tuple[dict[str, Received], dict]:  # type: ignore[type-arg]
        return await asyncio.gather(  # type: ignore[return-value]
            run_with_fault_async(fleet, restart),
            run_http_workload(fleet.http_port, HTTP_WORKLOAD),
        )

    received, http_received = asyncio.run(grpc_and_http())
    assert_same_outputs(baseline, received)
    # OpenAI streams went through the same restart (they were in flight: the gRPC workload
    # took longer than the restart, and both started together).
    assert http_received == http_undisturbed
    # The workers were not restarted: they registered again by themselves.
    stats = fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) >= 2, "workers back")
    assert all(w.popen is not None and w.popen.poll() is None for w in fleet.workers[2:])
    assert len(fleet.ready_replicas(stats)) >= 2
    fleet.assert_no_leak()


@pytest.fixture(scope="module")
def faulty_fleet(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetStack]:
    """Two workers with no swap space and a small cache (multi-sequence groups must be
    preempted by recompute), and a scheduler whose replica step raises once, mid-run."""
    stack = start_fleet(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("faulty-fleet-logs"),
        2,
        scheduler_args=[
            "--max-num-seqs",
            "32",
            "--num-cpu-blocks-override",
            "0",
            "--num-gpu-blocks-override",
            "48",
        ],
        env={"LLMSERVE_FAILPOINTS": "replica.finish_step=1+60"},
    )
    yield stack
    stack.stop()


def test_step_failure_and_zero_swap_lose_nothing(
    faulty_fleet: FleetStack, baseline: dict[str, Received]
):
    received = asyncio.run(run_workload(faulty_fleet.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    assert_same_outputs(baseline, received)
    stats = faulty_fleet.stats()
    assert sum(r.num_preemptions for r in stats.replicas) > 0, "no memory pressure"
    failed = [r for r in stats.replicas if r.num_migrated_out > 0]
    assert len(failed) == 1, stats  # exactly one replica's step raised
    scheduler_log = faulty_fleet.scheduler.log.read_text()  # type: ignore[union-attr]
    assert "failpoint replica.finish_step fired" in scheduler_log
    faulty_fleet.assert_no_leak()
    # The replica whose step failed is ready again and serves the next requests.
    steps_before = failed[0].num_steps
    faulty_fleet.wait_for(lambda s: len(faulty_fleet.ready_replicas(s)) == 2, "both ready")
    asyncio.run(run_workload(faulty_fleet.gateway.address, mixed_workload(24, seed=3)))  # type: ignore[union-attr]
    after = next(r for r in faulty_fleet.stats().replicas if r.replica_id == failed[0].replica_id)
    assert after.num_steps > steps_before
    faulty_fleet.assert_no_leak()


# A hybrid model's fleet: a tiny Gemma 3 whose windowed KV groups hold only their windows'
# blocks. Eight streams far longer than the window (tests/integration/test_kv_migration.py).
WINDOWED_WORKLOAD = long_workload(count=8, seed=5)


@pytest.fixture(scope="module")
def windowed_fleet(
    tiny_windowed_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetStack]:
    stack = start_fleet(
        str(tiny_windowed_dir),
        tmp_path_factory.mktemp("windowed-fleet-logs"),
        2,
        scheduler_args=["--max-num-seqs", "32"],
    )
    yield stack
    stack.stop()


def test_windowed_worker_kill_and_scheduler_restart_lose_nothing(windowed_fleet: FleetStack):
    """A worker killed, then the scheduler restarted, mid-run on a hybrid model: each time
    the windowed groups held only their windows' blocks before the fault, and every stream
    ends as the undisturbed run did, every block free."""
    fleet = windowed_fleet
    baseline = asyncio.run(run_workload(fleet.gateway.address, WINDOWED_WORKLOAD))  # type: ignore[union-attr]
    fleet.assert_no_leak()
    at_chunk = 8 * len(WINDOWED_WORKLOAD)  # every stream past its prompt, longer than a window
    victim = fleet.workers[0]

    def kill() -> None:
        fleet.assert_windows_hold_little(SERVICE_WINDOW, WORKER_BLOCK_SIZE)
        victim.kill()

    received = run_with_fault(fleet, kill, at_chunk, WINDOWED_WORKLOAD)
    assert_same_outputs(baseline, received)
    fleet.assert_no_leak()
    victim.start()
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "the restarted worker ready")

    scheduler = fleet.scheduler
    assert scheduler is not None

    def restart() -> None:
        fleet.assert_windows_hold_little(SERVICE_WINDOW, WORKER_BLOCK_SIZE)
        scheduler.kill()
        scheduler.start(wait=False)

    received = run_with_fault(fleet, restart, at_chunk, WINDOWED_WORKLOAD)
    assert_same_outputs(baseline, received)
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "workers back")
    fleet.assert_no_leak()
