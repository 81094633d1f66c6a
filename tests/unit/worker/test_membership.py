"""The worker's lease loop and DrainWorker call against a real in-process gRPC Scheduler
(a fake servicer on a loopback port: it records calls and grants what the test says)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from structlog.testing import capture_logs

from llmserve.ports import free_port
from worker_service.membership import (
    DRAIN_ATTEMPTS,
    LeaseKeeper,
    choose_scheduler,
    keep_lease,
    renew_interval_s,
    request_drain,
    retry_delay_s,
)

from .fake_scheduler import FakeScheduler, serve, until

WORKER = "127.0.0.1:50999"


class RecordingSleep:
    """asyncio.sleep that records each wait the keeper chose."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(seconds)


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())


async def cancel_then_stop(task: asyncio.Task[None], server: grpc.aio.Server) -> None:
    """End a keeper's task, then its fake scheduler's server."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await server.stop(0)


def test_renew_interval_is_a_third_of_the_lease_or_the_default():
    assert renew_interval_s(30_000) == pytest.approx(10.0)
    assert renew_interval_s(300) == pytest.approx(0.1)
    assert renew_interval_s(0) == 10.0  # an older scheduler grants no lease


def test_retry_backoff_doubles_and_is_capped_by_five_seconds_and_the_interval():
    assert [retry_delay_s(n, 10.0) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert [retry_delay_s(n, 1.5) for n in range(1, 5)] == [0.5, 1.0, 1.5, 1.5]


def test_keeper_renews_every_third_of_the_lease_and_logs_only_the_first_registration():
    async def body() -> None:
        fake = FakeScheduler(replica_id=4, lease_ms=300)
        server = await serve(fake, port := free_port())
        sleep = RecordingSleep()
        keeper = LeaseKeeper(f"127.0.0.1:{port}", WORKER, sleep=sleep)
        with capture_logs() as logs:
            task = asyncio.create_task(keeper.run())
            await until(lambda: keeper.registrations >= 4)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)
        assert set(fake.registered) == {WORKER}
        assert keeper.lease is not None and keeper.lease.replica_id == 4
        assert sleep.waits[:3] == [pytest.approx(0.1)] * 3
        events = [e["event"] for e in logs]
        assert events.count("registered with scheduler") == 1
        assert "scheduler not reachable; retrying with backoff" not in events

    run(body)


def test_keeper_re_registers_with_a_restarted_scheduler_within_one_interval():
    async def body() -> None:
        port = free_port()
        first = FakeScheduler(replica_id=0, lease_ms=1500)  # renew every 0.5 s
        server = await serve(first, port)
        sleep = RecordingSleep()
        keeper = LeaseKeeper(f"127.0.0.1:{port}", WORKER, sleep=sleep)
        with capture_logs() as logs:
            task = asyncio.create_task(keeper.run())
            await until(lambda: bool(first.registered))
            await server.stop(0)  # the scheduler goes away ...
            await until(lambda: sum(e["event"] == "registration failed again" for e in logs) >= 2)
            second = FakeScheduler(replica_id=9, lease_ms=1500)  # ... and comes back, empty
            server = await serve(second, port)
            await until(lambda: keeper.registrations == 2)  # the reply reached the keeper
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)
        assert second.registered[0] == WORKER
        assert keeper.lease is not None and keeper.lease.replica_id == 9
        # No wait the keeper chose, renewal or retry, was longer than one renewal interval,
        # so the restarted scheduler heard from it within one interval of coming back.
        assert sleep.waits and max(sleep.waits) <= renew_interval_s(1500)
        events = [e["event"] for e in logs]
        # State changes are logged once each, not once per attempt.
        assert events.count("scheduler not reachable; retrying with backoff") == 1
        assert events.count("registered with scheduler") == 2
        again = [e for e in logs if e["event"] == "registered with scheduler"][1]
        assert again["replica"] == 9 and again["failed_attempts"] >= 3

    run(body)


def test_keeper_registers_at_once_when_asked_instead_of_at_the_next_renewal():
    """The worker's Execute stream closed (the scheduler restarted, or dropped it): renew_now
    cuts the keeper's wait short. Its sleeps here never end, so only renew_now can bring the
    second and third registrations."""

    async def body() -> None:
        fake = FakeScheduler(replica_id=3, lease_ms=60_000)  # renew every 20 s
        server = await serve(fake, port := free_port())
        waits: list[float] = []

        async def forever(seconds: float) -> None:
            waits.append(seconds)
            await asyncio.Event().wait()

        keeper = LeaseKeeper(f"127.0.0.1:{port}", WORKER, sleep=forever)
        task = asyncio.create_task(keeper.run())
        try:
            await until(lambda: keeper.registrations == 1 and len(waits) == 1)
            keeper.renew_now()
            await until(lambda: keeper.registrations == 2 and len(waits) == 2)
            keeper.renew_now()
            await until(lambda: keeper.registrations == 3)
        finally:
            await cancel_then_stop(task, server)
        assert fake.registered == [WORKER] * 3
        assert waits[:2] == [renew_interval_s(60_000)] * 2

    run(body)


def test_keep_lease_renews_when_the_holders_stream_closes():
    async def body() -> None:
        # Renewals every 200 s: longer than `until` waits, so only the closed stream renews.
        fake = FakeScheduler(replica_id=5, lease_ms=600_000)
        server = await serve(fake, port := free_port())

        class Holder:
            stream_open = False
            on_stream_closed: Callable[[], None] = staticmethod(lambda: None)

        holder = Holder()
        keeper, task = keep_lease(holder, f"127.0.0.1:{port}", WORKER)
        try:
            await until(lambda: keeper.registrations == 1)
            holder.on_stream_closed()  # as WorkerServicer.Execute does when its stream ends
            await until(lambda: keeper.registrations == 2)
        finally:
            await cancel_then_stop(task, server)
        assert fake.registered == [WORKER] * 2

    run(body)


def test_keeper_stops_once_the_scheduler_refuses_it_as_drained():
    async def body() -> None:
        fake = FakeScheduler(replica_id=2, lease_ms=300)  # renew every 0.1 s
        server = await serve(fake, port := free_port())
        keeper = LeaseKeeper(f"127.0.0.1:{port}", WORKER)
        with capture_logs() as logs:
            task = asyncio.create_task(keeper.run())
            await until(lambda: keeper.registrations >= 1)
            fake.refuse_registrations = True
            async with asyncio.timeout(10):
                await task  # returns by itself
            attempts = len(fake.registered)
            await asyncio.sleep(0.5)  # five renewal intervals: no further attempt
        await server.stop(0)
        assert len(fake.registered) == attempts
        events = [e["event"] for e in logs]
        assert events.count("the scheduler drained this worker; registration stops") == 1
        assert "scheduler not reachable; retrying with backoff" not in events

    run(body)


def test_keeper_uses_the_default_interval_when_the_scheduler_grants_no_lease():
    async def body() -> None:
        fake = FakeScheduler(replica_id=1, lease_ms=0)
        server = await serve(fake, port := free_port())
        waits: list[float] = []

        async def record(seconds: float) -> None:
            waits.append(seconds)
            await asyncio.Event().wait()  # never returns; the task is cancelled

        task = asyncio.create_task(LeaseKeeper(f"127.0.0.1:{port}", WORKER, sleep=record).run())
        await until(lambda: bool(waits))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)
        assert waits == [10.0]

    run(body)


def test_request_drain_returns_the_schedulers_answer():
    async def body() -> None:
        fake = FakeScheduler(replica_id=2, lease_ms=0)
        server = await serve(fake, port := free_port())
        reply = await request_drain(f"127.0.0.1:{port}", WORKER)
        await server.stop(0)
        assert reply is not None and (reply.replica_id, reply.num_requests) == (2, 3)
        assert fake.drained == [WORKER]

    run(body)


def test_request_drain_gives_up_at_once_on_a_refusal_and_retries_when_unavailable():
    async def body() -> None:
        refusing = FakeScheduler(0, 0, drain_code=grpc.StatusCode.NOT_FOUND)
        server = await serve(refusing, port := free_port())
        assert await request_drain(f"127.0.0.1:{port}", WORKER) is None
        await server.stop(0)
        assert refusing.drained == [WORKER]

        busy = FakeScheduler(0, 0, drain_code=grpc.StatusCode.UNAVAILABLE)
        server = await serve(busy, port)
        assert await request_drain(f"127.0.0.1:{port}", WORKER) is None
        await server.stop(0)
        assert busy.drained == [WORKER] * DRAIN_ATTEMPTS

    run(body)


# -- scheduler shards ------------------------------------------------------------------------------


def test_keeper_joins_the_shard_with_the_fewest_workers():
    async def body() -> None:
        busy, light = FakeScheduler(1, 300), FakeScheduler(2, 300)
        busy.num_replicas, light.num_replicas = 3, 1
        ports = free_port(), free_port()
        servers = [await serve(busy, ports[0]), await serve(light, ports[1])]
        shards = [f"127.0.0.1:{p}" for p in ports]
        keeper = LeaseKeeper(shards, WORKER)
        task = asyncio.create_task(keeper.run())
        await until(lambda: keeper.registrations >= 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for server in servers:
            await server.stop(0)
        assert keeper.scheduler == shards[1]
        assert busy.registered == [] and light.registered[:2] == [WORKER, WORKER]

    run(body)


def test_choice_among_equal_or_silent_shards_depends_on_the_worker_only():
    async def body() -> None:
        silent = [f"127.0.0.1:{free_port()}" for _ in range(4)]  # nothing listens
        chosen = {w: await choose_scheduler(silent, w) for w in ("10.0.0.1:1", "10.0.0.2:1")}
        assert all(c in silent for c in chosen.values())
        for worker, shard in chosen.items():
            assert await choose_scheduler(list(reversed(silent)), worker) == shard
        picks = {await choose_scheduler(silent, f"10.0.0.{i}:50061") for i in range(40)}
        assert len(picks) >= 3, "workers should spread over silent shards"

    run(body)


def keeper_after_loss(stream_open: bool) -> tuple[FakeScheduler, LeaseKeeper]:
    """A keeper registered with shard A (fewer workers), after A's server is stopped."""
    result: list[tuple[FakeScheduler, LeaseKeeper]] = []

    async def body() -> None:
        first, other = FakeScheduler(1, 300), FakeScheduler(2, 300)
        other.num_replicas = 2
        ports = free_port(), free_port()
        servers = [await serve(first, ports[0]), await serve(other, ports[1])]
        keeper = LeaseKeeper(
            [f"127.0.0.1:{p}" for p in ports], WORKER, stream_open=lambda: stream_open
        )
        task = asyncio.create_task(keeper.run())
        await until(lambda: keeper.registrations >= 1)
        assert first.registered and not other.registered
        await servers[0].stop(0)  # shard A is gone
        if stream_open:
            await asyncio.sleep(1.5)  # several renewal attempts
        else:
            # Registered there: the other shard granted the lease (its replica id is 2).
            await until(lambda: keeper.lease is not None and keeper.lease.replica_id == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await servers[1].stop(0)
        result.append((other, keeper))

    run(body)
    return result[0]


def test_keeper_moves_to_another_shard_when_its_own_is_gone():
    other, keeper = keeper_after_loss(stream_open=False)
    assert other.registered == [WORKER] * len(other.registered) and other.registered
    assert keeper.lease is not None and keeper.lease.replica_id == 2  # granted by the other


def test_keeper_stays_while_its_shard_still_drives_the_worker():
    other, keeper = keeper_after_loss(stream_open=True)
    assert other.registered == []
    assert keeper.lease is not None and keeper.lease.replica_id == 1
