"""Whether the gateway can serve: a scheduler (shard) is connected and has a ready worker.

The scheduler reports SERVING on grpc.health.v1 only while at least one worker replica is
ready, so the gateway watches that status (a Health.Watch stream, re-opened when it breaks)
instead of asking the scheduler on every probe. The gateway's own gRPC health and its HTTP
`/ready` follow the result; `/health` stays liveness only, so that an orchestrator restarts a
gateway that is stuck, not every gateway whenever the scheduler restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import security
from llmserve.grpc_utils import channel_options
from llmserve.logs import get_logger
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Pause before re-opening a broken Watch stream: short, since readiness lags by this much.
RETRY_S = 1.0


class SchedulerReadiness:
    """Follows the scheduler's health; `ready` combines it with the Connect stream's state,
    and `on_change` hears of each change of it.

    Each time the scheduler turns SERVING (a worker is ready there), the gateway asks it for
    the model's max_model_len (GetStats) and hands it to `on_max_model_len`: the scheduler
    decides it from its workers, the gateway only learns it."""

    def __init__(
        self,
        address: str,
        is_connected: Callable[[], bool],
        retry_s: float = RETRY_S,
        on_max_model_len: Callable[[int], None] | None = None,
        on_change: Callable[[], object] = lambda: None,
    ) -> None:
        self.address = address
        self._is_connected = is_connected
        self._retry_s = retry_s
        self._on_max_model_len = on_max_model_len
        self._on_change = on_change
        self._scheduler_serving = False
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def drain(self) -> None:
        """Not ready from now on, whatever the scheduler says (SIGTERM)."""
        self._draining = True

    def not_ready_reason(self) -> str | None:
        """None when ready; otherwise why not, for `/ready`'s answer."""
        if self._draining:
            return "draining"
        if not self._is_connected():
            return "scheduler unavailable"
        if not self._scheduler_serving:
            return "no ready worker"
        return None

    @property
    def ready(self) -> bool:
        return self.not_ready_reason() is None

    @property
    def scheduler_serving(self) -> bool:
        """The scheduler's last health status: SERVING (it has a ready worker)."""
        return self._scheduler_serving

    async def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        while True:
            try:
                async with security.aio_channel(self.address, options=channel_options()) as ch:
                    async for reply in health_pb2_grpc.HealthStub(ch).Watch(request):
                        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                        if serving != self._scheduler_serving:
                            log.info("scheduler health", address=self.address, serving=serving)
                            if serving:
                                await self._learn_max_model_len(ch)
                            self._set_serving(serving)
            except grpc.aio.AioRpcError as exc:
                log.debug("scheduler health watch broke", code=exc.code().name)
            self._set_serving(False)
            await asyncio.sleep(self._retry_s)

    def _set_serving(self, serving: bool) -> None:
        changed = serving != self._scheduler_serving
        self._scheduler_serving = serving
        if changed:
            self._on_change()

    async def _learn_max_model_len(self, channel: grpc.aio.Channel) -> None:
        if self._on_max_model_len is None:
            return
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
        if stats.max_model_len:
            self._on_max_model_len(stats.max_model_len)


class ShardsReadiness:
    """The gateway's readiness over its scheduler shards: ready while any one of them is (the
    client places requests on the shards that are)."""

    def __init__(self, shards: list[SchedulerReadiness]) -> None:
        self.shards = {shard.address: shard for shard in shards}

    def start(self) -> None:
        for shard in self.shards.values():
            shard.start()

    async def close(self) -> None:
        await asyncio.gather(*(shard.close() for shard in self.shards.values()))

    def drain(self) -> None:
        for shard in self.shards.values():
            shard.drain()

    def serving(self, address: str) -> bool:
        return self.shards[address].scheduler_serving

    def not_ready_reason(self) -> str | None:
        reasons = {address: s.not_ready_reason() for address, s in self.shards.items()}
        if None in reasons.values():
            return None
        if len(reasons) == 1:
            return next(iter(reasons.values()))
        return "; ".join(f"{address}: {reason}" for address, reason in reasons.items())
