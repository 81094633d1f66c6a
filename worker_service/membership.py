"""A worker's place in the fleet: its lease with the scheduler, and its drain on SIGTERM.

Lease. `LeaseKeeper.run` calls RegisterWorker and then calls it again every third of the
granted lease, for the worker's whole life, so that a restarted scheduler re-learns the worker
within one renewal interval. A third leaves room for two failed renewals (each bounded by its
own deadline) before the lease lapses. A scheduler that grants no lease (lease_ms 0, an older
one) is renewed every `DEFAULT_RENEW_INTERVAL_S`, which it treats as a harmless re-add of the
same address. While the scheduler does not answer, the keeper retries with exponential backoff,
never waiting longer than the renewal interval, on a fresh channel each time (a channel that
saw its server go away may otherwise wait out gRPC's own reconnect backoff, up to two minutes).
When the scheduler's Execute stream closes here (`renew_now`), the keeper registers at once
instead of at its next renewal: a restarted scheduler, or one that dropped this worker, learns
of it within the retry backoff rather than a whole renewal interval later.

Shards. `--scheduler` may name several schedulers (shards), each driving its own workers. The
worker registers with one: the one with the fewest replicas among those that answer GetStats
(ties broken by a hash of the worker's address, so workers starting together spread). When a
renewal fails and no Execute stream is open (the scheduler is gone, not merely slow), it
chooses again among the others at once: the surviving shards take over a lost one's workers.

Drain. `WorkerDrain.run` is what SIGTERM (or a first Ctrl-C) does: health turns NOT_SERVING
at once; the lease stops being renewed (a renewal after the drain would re-add the replica); if
the worker knows its scheduler it asks for DrainWorker; then it waits until the scheduler holds
nothing on it, bounded by the drain timeout. "Nothing on it" is the first of:
  - no Execute stream is open: the scheduler dropped the drained replica (or never connected,
    or went away), so no sequence of it lives here;
  - the stream is open but the worker holds no sequence state and no step arrived for
    `DRAIN_QUIET_S`: an idle replica of a scheduler that does not close drained streams.
    Should the scheduler route a request here just then, the worker's exit is a worker loss to
    it, and the request moves to another replica by recompute: a pause, not an error.
A second SIGTERM or SIGINT during the drain stops the worker at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health

from llmserve import security
from llmserve.grpc_utils import channel_options
from llmserve.logs import get_logger
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

# Renewal interval when the scheduler grants no lease (lease_ms == 0).
DEFAULT_RENEW_INTERVAL_S = 10.0
# Renew when this fraction of the lease has passed.
RENEW_FRACTION = 1 / 3
# Retry backoff while the scheduler does not answer: first delay and cap.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
# Deadline of one RegisterWorker call (also capped by the renewal interval, at least 1 s).
REGISTER_TIMEOUT_S = 5.0
# Deadline of the GetStats call that asks a shard how many workers it has.
CHOOSE_TIMEOUT_S = 2.0
# DrainWorker: attempts, and the deadline of each.
DRAIN_ATTEMPTS = 3
DRAIN_CALL_TIMEOUT_S = 2.0
# An open but idle stream with no sequence state counts as drained after this long.
DRAIN_QUIET_S = 2.0

Sleep = Callable[[float], Awaitable[None]]


def renew_interval_s(lease_ms: int) -> float:
    """Seconds between renewals of a lease of `lease_ms` (0: the scheduler grants none)."""
    if lease_ms <= 0:
        return DEFAULT_RENEW_INTERVAL_S
    return lease_ms / 1000 * RENEW_FRACTION


def retry_delay_s(failures: int, interval_s: float) -> float:
    """Wait after the `failures`-th failed call in a row: doubling from RETRY_FIRST_S, capped
    at RETRY_MAX_S and at the renewal interval (retrying less often would let a lease lapse
    that one more attempt could have kept)."""
    return min(RETRY_FIRST_S * 2 ** (failures - 1), RETRY_MAX_S, interval_s)


@dataclass(frozen=True, slots=True)
class Lease:
    """What the scheduler granted at the last successful registration."""

    replica_id: int
    lease_ms: int
    granted_at: float  # time.monotonic()


async def choose_scheduler(schedulers: Sequence[str], advertised: str) -> str:
    """The shard to register with: fewest live replicas among those that answer GetStats, ties
    (and, when none answers, the whole order) broken by rendezvous hashing of `advertised`."""

    def score(scheduler: str) -> bytes:
        return hashlib.blake2b(f"{advertised}\0{scheduler}".encode(), digest_size=8).digest()

    async def replicas(scheduler: str) -> int | None:
        try:
            async with security.aio_channel(scheduler, options=channel_options()) as channel:
                stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                    scheduler_pb2.GetStatsRequest(), timeout=CHOOSE_TIMEOUT_S
                )
        except grpc.aio.AioRpcError:
            return None
        return sum(r.state != scheduler_pb2.WORKER_STATE_LOST for r in stats.replicas)

    counts = await asyncio.gather(*(replicas(s) for s in schedulers))
    answered = [(n, s) for n, s in zip(counts, schedulers, strict=True) if n is not None]
    if not answered:
        return max(schedulers, key=score)
    return min(answered, key=lambda pair: (pair[0], -int.from_bytes(score(pair[1]), "big")))[1]


class LeaseKeeper:
    """Keeps this worker registered as `advertised` with one of `schedulers` (see the module
    doc); `scheduler` is the one it registers with now.

    `run()` returns only when the scheduler refuses the worker because it drained it
    (FAILED_PRECONDITION: renewing would be refused every interval); otherwise cancel its task
    to stop renewing. `stream_open` says whether a scheduler's Execute stream is open here.
    `sleep` is injectable so tests can record the waits the keeper chooses."""

    def __init__(
        self,
        schedulers: str | Sequence[str],
        advertised: str,
        sleep: Sleep = asyncio.sleep,
        stream_open: Callable[[], bool] = lambda: False,
    ) -> None:
        self.schedulers = [schedulers] if isinstance(schedulers, str) else list(schedulers)
        self.scheduler = self.schedulers[0]
        self.advertised = advertised
        self._stream_open = stream_open
        self.lease: Lease | None = None
        self.registrations = 0  # successful RegisterWorker calls
        self._sleep = sleep
        self._renew = asyncio.Event()  # set by renew_now: cut the current wait short
        self._failures = 0
        self._lapse_logged = False

    @property
    def interval_s(self) -> float:
        return renew_interval_s(self.lease.lease_ms if self.lease else 0)

    async def run(self) -> None:
        request = scheduler_pb2.RegisterWorkerRequest(address=self.advertised)
        if len(self.schedulers) > 1:
            self.scheduler = await choose_scheduler(self.schedulers, self.advertised)
        while True:
            async with security.aio_channel(self.scheduler, options=channel_options()) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                while True:
                    timeout = min(REGISTER_TIMEOUT_S, max(self.interval_s, 1.0))
                    try:
                        reply = await stub.RegisterWorker(request, timeout=timeout)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                            log.info(
                                "the scheduler drained this worker; registration stops",
                                scheduler=self.scheduler,
                                reason=exc.details(),
                            )
                            return
                        self._failed(exc)
                        break  # a fresh channel for the next attempt
                    self._granted(reply)
                    await self._wait(self.interval_s)
            if len(self.schedulers) > 1 and not self._stream_open():
                await self._move()
            await self._wait(retry_delay_s(self._failures, self.interval_s))

    def renew_now(self) -> None:
        """Register again at once rather than after the current wait: the scheduler's Execute
        stream closed here (it went away, or dropped this worker)."""
        self._renew.set()

    async def _wait(self, seconds: float) -> None:
        """`sleep(seconds)`, cut short by renew_now."""
        if not self._renew.is_set():
            sleeping = asyncio.ensure_future(self._sleep(seconds))
            woken = asyncio.ensure_future(self._renew.wait())
            try:
                await asyncio.wait((sleeping, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeping.cancel()
                woken.cancel()
                await asyncio.gather(sleeping, woken, return_exceptions=True)
        self._renew.clear()

    async def _move(self) -> None:
        """Choose a shard again, among the others than the one that just failed."""
        others = [s for s in self.schedulers if s != self.scheduler]
        chosen = await choose_scheduler(others, self.advertised)
        log.info("registering with another scheduler shard", failed=self.scheduler, chosen=chosen)
        self.scheduler = chosen
        self.lease = None

    def _granted(self, reply: scheduler_pb2.RegisterWorkerResponse) -> None:
        previous, self.lease = self.lease, Lease(reply.replica_id, reply.lease_ms, time.monotonic())
        self.registrations += 1
        changed = previous is None or (previous.replica_id, previous.lease_ms) != (
            reply.replica_id,
            reply.lease_ms,
        )
        if self._failures or changed:
            log.info(
                "registered with scheduler",
                scheduler=self.scheduler,
                advertised=self.advertised,
                replica=reply.replica_id,
                lease_ms=reply.lease_ms,
                renew_every_s=round(self.interval_s, 3),
                failed_attempts=self._failures,
            )
        self._failures = 0
        self._lapse_logged = False

    def _failed(self, exc: grpc.aio.AioRpcError) -> None:
        self._failures += 1
        fields = dict(scheduler=self.scheduler, code=exc.code().name, reason=exc.details())
        if self._failures == 1:
            log.warning("scheduler not reachable; retrying with backoff", **fields)
        else:
            log.debug("registration failed again", attempt=self._failures, **fields)
        lease = self.lease
        if (
            lease is not None
            and lease.lease_ms > 0
            and not self._lapse_logged
            and time.monotonic() - lease.granted_at > lease.lease_ms / 1000
        ):
            self._lapse_logged = True
            log.warning(
                "lease lapsed: unless the scheduler is stepping this worker (its steps and "
                "health checks renew the lease), it counts it as lost until it answers again",
                scheduler=self.scheduler,
                lease_ms=lease.lease_ms,
            )


class StreamHolder(Protocol):
    """What the lease keeper watches: the Worker servicer's Execute stream."""

    @property
    def stream_open(self) -> bool: ...

    # Called when a scheduler's Execute stream ends here.
    on_stream_closed: Callable[[], None]


def keep_lease(
    holder: StreamHolder, schedulers: str | Sequence[str], advertised: str
) -> tuple[LeaseKeeper, asyncio.Task[None]]:
    """Register `advertised` with one of `schedulers` and keep renewing, at once when the
    Execute stream ends (see LeaseKeeper): the keeper and its task."""
    keeper = LeaseKeeper(schedulers, advertised, stream_open=lambda: holder.stream_open)
    holder.on_stream_closed = keeper.renew_now
    return keeper, asyncio.create_task(keeper.run())


class DrainTarget(Protocol):
    """What the drain watches: the Worker servicer's stream and sequence state."""

    @property
    def stream_open(self) -> bool: ...

    def start_draining(self) -> None:
        """Refuse new Execute streams from now on."""

    async def wait_idle(self, quiet_s: float) -> str:
        """Return (the reason) once the scheduler holds nothing on this worker."""


async def request_drain(scheduler: str, address: str) -> scheduler_pb2.DrainWorkerResponse | None:
    """DrainWorker(address), retried briefly; None when the scheduler did not take it."""
    async with security.aio_channel(scheduler, options=channel_options()) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for attempt in range(1, DRAIN_ATTEMPTS + 1):
            try:
                reply = await stub.DrainWorker(
                    scheduler_pb2.DrainWorkerRequest(address=address),
                    timeout=DRAIN_CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                retryable = exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                log.warning(
                    "DrainWorker failed",
                    scheduler=scheduler,
                    code=exc.code().name,
                    reason=exc.details(),
                    attempt=attempt,
                    will_retry=retryable and attempt < DRAIN_ATTEMPTS,
                )
                if not retryable or attempt == DRAIN_ATTEMPTS:
                    return None
                await asyncio.sleep(retry_delay_s(attempt, RETRY_MAX_S))
                continue
            log.info(
                "scheduler is draining this worker",
                replica=reply.replica_id,
                num_requests=reply.num_requests,
            )
            return reply
    return None


class WorkerDrain:
    """The worker's reaction to SIGTERM; pass `run` to `serve_until_signal` as `on_stop`.

    `exit_code` afterwards: 0 drained, 1 timed out or cut short by a second signal."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        target: DrainTarget,
        *,
        timeout_s: float,
        scheduler: str | None = None,
        advertised: str = "",
        lease_task: asyncio.Task[None] | None = None,
        quiet_s: float = DRAIN_QUIET_S,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        self.server = server
        self.health_servicer = health_servicer
        self.target = target
        self.timeout_s = timeout_s
        self._scheduler = scheduler
        self._keeper = keeper
        self.advertised = advertised
        self.lease_task = lease_task
        self.quiet_s = quiet_s
        self.exit_code = 0

    @property
    def scheduler(self) -> str | None:
        """The scheduler to ask for DrainWorker: the lease keeper's shard, when it keeps one."""
        return self._keeper.scheduler if self._keeper is not None else self._scheduler

    async def run(self) -> None:
        started = time.monotonic()
        forced = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, forced.set)
        # NOT_SERVING for every service name, and it stays so whatever sets SERVING later.
        await self.health_servicer.enter_graceful_shutdown()
        self.target.start_draining()
        log.info("draining", timeout_s=self.timeout_s, scheduler=self.scheduler)
        if self.lease_task is not None:
            self.lease_task.cancel()
            await asyncio.gather(self.lease_task, return_exceptions=True)
        idle = asyncio.create_task(self._settle())
        cut = asyncio.create_task(forced.wait())
        done, _ = await asyncio.wait(
            {idle, cut}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in (idle, cut):
            task.cancel()
        await asyncio.gather(idle, cut, return_exceptions=True)
        waited_s = round(time.monotonic() - started, 3)
        if idle in done:
            log.info("drained", reason=idle.result(), waited_s=waited_s)
        elif cut in done:
            self.exit_code = 1
            log.warning("second signal: stopping without waiting for the drain", waited_s=waited_s)
        else:
            self.exit_code = 1
            log.warning(
                "drain timed out; stopping with sequences still here (the scheduler moves them)",
                timeout_s=self.timeout_s,
                stream_open=self.target.stream_open,
            )
        # Nothing the scheduler needs is left in flight; do not wait out a grace period.
        await self.server.stop(grace=0)

    async def _settle(self) -> str:
        # The scheduler hears of the drain before the worker looks idle: an idle worker that
        # vanished unannounced would count as lost, not drained.
        if self.scheduler:
            await request_drain(self.scheduler, self.advertised)
        return await self.target.wait_idle(self.quiet_s)
