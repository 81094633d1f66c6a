"""Drain by migration with real processes: a draining worker's 16 running streams move to
another worker with their KV blocks (worker to worker, ReadBlocks), and a worker SIGKILLed in
the middle of a transfer, source or destination, makes the moves fall back to recompute. In
every case each stream's tokens equal an undisturbed run's, and every replica left ends with
free == total blocks, no transfer holding blocks and its block accounting's invariants holding.
A peer that lacks the internal credential is refused its reads, and the moves fall back.

Each test starts one worker (every stream runs there) and a spare the scheduler does not know;
once the streams are running, the test registers the spare (renewing its lease as the worker
would) and drains the first worker.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from tests.support.fleet import (
    FleetStack,
    Received,
    assert_same_outputs,
    run_workload,
    spare_worker,
    start_fleet,
)
from tests.support.models import SERVICE_WINDOW
from worker_service.config import WorkerConfig

# The block size the stacks' workers run with (their default).
WORKER_BLOCK_SIZE = next(f.default for f in fields(WorkerConfig) if f.name == "block_size")

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

NUM_STREAMS = 16


def long_workload(
    count: int = NUM_STREAMS, seed: int = 3, max_tokens: int = 280
) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """Streams long enough to be mid-run when the drain comes: 100-160 token prompts (some
    sharing a 48-token prefix), `max_tokens` tokens each; greedy and seeded, one n=2, some
    logprobs."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 20000) for _ in range(48)]
    requests = []
    for i in range(count):
        prompt = (shared if i % 4 == 0 else []) + [
            rng.randrange(100, 20000) for _ in range(rng.randrange(100, 160))
        ]
        params: dict = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}  # type: ignore[type-arg]
        if i % 2:
            params.update(temperature=0.8, seed=500 + i)
        if i == 3:
            params["n"] = 2
        if i % 5 == 1:
            params["logprobs"] = 2
        requests.append((f"long-{i}", {"prompt": prompt, **params}))
    return requests


WORKLOAD = long_workload()


def one_worker_stack(
    model: str, log_dir: Path, env: dict[str, str] | None = None, token: str = ""
) -> FleetStack:
    return start_fleet(
        model, log_dir, 1, scheduler_args=["--max-num-seqs", "32"], env=env, token=token
    )


def scheduler_log(stack: FleetStack) -> str:
    return stack.scheduler.log.read_text(errors="replace")  # type: ignore[union-attr]


def events(stack: FleetStack, event: str) -> list[str]:
    return [line for line in scheduler_log(stack).splitlines() if f'"event": "{event}"' in line]


def run_with(
    stack: FleetStack,
    fault: Callable[[], None],
    at_chunk: int,
    workload: list[tuple[str, dict]] = WORKLOAD,  # type: ignore[type-arg]
) -> dict[str, Received]:
    """The workload; `fault()` runs on a thread once `at_chunk` tokens have arrived (every
    stream running by then), and must be done before the workload's end."""
    thread = threading.Thread(target=fault)

    def on_chunk(total: int) -> None:
        if total >= at_chunk and thread.ident is None:
            thread.start()

    received = asyncio.run(run_workload(stack.gateway.address, workload, on_chunk))  # type: ignore[union-attr]
    assert thread.ident is not None, "the workload ended before the fault"
    thread.join()
    return received


def undisturbed(model_dir: Path, log_dir: Path) -> dict[str, Received]:
    """The workload on one worker of `model_dir`, nothing moved."""
    stack = one_worker_stack(str(model_dir), log_dir)
    try:
        received = asyncio.run(run_workload(stack.gateway.address, WORKLOAD))  # type: ignore[union-attr]
        stack.assert_no_leak()
        return received
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def baseline(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Received]:
    return undisturbed(tiny_model_dir, tmp_path_factory.mktemp("kv-baseline"))


@pytest.fixture
def stack_factory(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., FleetStack]]:
    stacks: list[FleetStack] = []

    def make(env: dict[str, str] | None = None, token: str = "") -> FleetStack:
        log_dir = tmp_path / f"s{len(stacks)}"
        stacks.append(one_worker_stack(str(tiny_model_dir), log_dir, env, token))
        return stacks[-1]

    yield make
    for stack in stacks:
        stack.stop()


def test_drain_moves_16_running_streams_with_their_kv_blocks(stack_factory, baseline):  # type: ignore[no-untyped-def]
    stack = stack_factory()
    source = stack.workers[0].address
    spare = spare_worker(stack, "spare")
    on_source: list[int] = []

    def move_off() -> None:
        stack.lease(spare.address)
        stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
        on_source.append(stack.drain(source))

    received = run_with(stack, move_off, at_chunk=2 * NUM_STREAMS)
    assert_same_outputs(baseline, received)
    assert on_source == [NUM_STREAMS], "every stream was running on the drained worker"
    moved = events(stack, "request moved with its KV blocks")
    assert len(moved) == NUM_STREAMS, moved
    assert all(spare.address in line for line in moved)
    assert not events(stack, "KV transfer failed; the request moves by recompute")
    migrated = events(stack, "request migrated")
    assert len(migrated) == NUM_STREAMS
    assert all('"how": "transfer"' in line for line in migrated)
    stack.wait_for(lambda s: source not in {r.address for r in s.replicas}, "the drain")
    stack.assert_no_leak()


def test_source_killed_mid_transfer_falls_back_to_recompute(stack_factory, baseline):  # type: ignore[no-untyped-def]
    # The first worker SIGKILLs itself while serving the first export a peer reads.
    stack = stack_factory(env={"LLMSERVE_FAILPOINTS": "worker.read_blocks=1"})
    source = stack.workers[0]
    spare = spare_worker(stack, "spare", env={"LLMSERVE_FAILPOINTS": ""})

    def move_off() -> None:
        stack.lease(spare.address)
        stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
        stack.drain(source.address)

    received = run_with(stack, move_off, at_chunk=2 * NUM_STREAMS)
    assert_same_outputs(baseline, received)
    assert source.popen is not None and source.popen.wait(timeout=30) == -9
    assert not events(stack, "request moved with its KV blocks")
    assert len(events(stack, "request migrated")) >= NUM_STREAMS
    stack.assert_no_leak()


def test_destination_killed_mid_transfer_falls_back_to_recompute(stack_factory, baseline):  # type: ignore[no-untyped-def]
    stack = stack_factory()
    source = stack.workers[0].address
    # The first spare SIGKILLs itself once the first export's header has arrived.
    doomed = spare_worker(stack, "doomed", env={"LLMSERVE_FAILPOINTS": "worker.import_blocks=1"})
    survivor = spare_worker(stack, "survivor")

    def move_off() -> None:
        stack.lease(doomed.address)
        stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the doomed spare ready")
        stack.drain(source)
        assert doomed.popen is not None and doomed.popen.wait(timeout=30) == -9
        stack.lease(survivor.address)  # the moved streams wait for it

    received = run_with(stack, move_off, at_chunk=2 * NUM_STREAMS)
    assert_same_outputs(baseline, received)
    failed = events(stack, "KV transfer failed; the request moves by recompute")
    assert failed and all("target lost" in line for line in failed), failed
    assert not events(stack, "request moved with its KV blocks")
    stack.wait_for(
        lambda s: {r.address for r in stack.ready_replicas(s)} == {survivor.address},
        "only the survivor left",
    )
    stack.assert_no_leak()


def test_a_peer_without_the_credential_is_refused_and_the_moves_fall_back(stack_factory, baseline):  # type: ignore[no-untyped-def]
    """Every service requires the internal token. The spare accepts it (so the scheduler
    drives it) but sends another one of its own: the source refuses its ReadBlocks, each import
    fails UNAUTHENTICATED, and the streams move by recompute."""
    fleet_token = "fleet-token-" + "a" * 20
    stack = stack_factory(token=fleet_token)
    source = stack.workers[0].address
    spare = spare_worker(
        stack, "spare", env={"LLMSERVE_INTERNAL_TOKEN": f"other-token-{'b' * 20} {fleet_token}"}
    )

    def move_off() -> None:
        stack.lease(spare.address)
        stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
        stack.drain(source)

    received = run_with(stack, move_off, at_chunk=2 * NUM_STREAMS)
    assert_same_outputs(baseline, received)
    failed = events(stack, "KV transfer failed; the request moves by recompute")
    assert failed and all("UNAUTHENTICATED" in line for line in failed), failed
    assert not events(stack, "request moved with its KV blocks")
    migrated = events(stack, "request migrated")
    assert len(migrated) == NUM_STREAMS
    assert all('"how": "recompute"' in line for line in migrated)
    stack.wait_for(lambda s: source not in {r.address for r in s.replicas}, "the drain")
    stack.assert_no_leak()


@pytest.fixture(scope="module")
def windowed_baseline(
    tiny_windowed_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Received]:
    return undisturbed(tiny_windowed_dir, tmp_path_factory.mktemp("kv-windowed"))


def test_drain_moves_windowed_streams_with_the_blocks_of_every_kv_group(
    tiny_windowed_dir: Path, tmp_path: Path, windowed_baseline: dict[str, Received]
) -> None:
    """A hybrid model (a full KV group beside windowed ones): each stream's windowed groups
    hold only their windows' blocks while it runs, and the drain moves the blocks of every
    group, so the streams continue on the spare with their outputs unchanged."""
    stack = one_worker_stack(str(tiny_windowed_dir), tmp_path / "windowed")
    try:
        source = stack.workers[0].address
        spare = spare_worker(stack, "spare")

        def move_off() -> None:
            stack.assert_windows_hold_little(SERVICE_WINDOW, WORKER_BLOCK_SIZE)
            stack.lease(spare.address)
            stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
            stack.drain(source)

        received = run_with(stack, move_off, at_chunk=4 * NUM_STREAMS)
        assert_same_outputs(windowed_baseline, received)
        moved = events(stack, "request moved with its KV blocks")
        assert len(moved) == NUM_STREAMS, moved
        assert not events(stack, "KV transfer failed; the request moves by recompute")
        stack.wait_for(lambda s: source not in {r.address for r in s.replicas}, "the drain")
        stack.assert_no_leak()
    finally:
        stack.stop()
