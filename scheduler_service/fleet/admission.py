"""What the scheduler admits: a bounded waiting queue, nothing new while draining, and
per-request deadlines.

The waiting queue is every request not yet running: the replicas' `waiting` queues and the
fleet's requests that wait for a ready worker. Beyond `max_waiting` a new request is refused
at once (RESOURCE_EXHAUSTED, which the gateway passes on as 429 / RESOURCE_EXHAUSTED), so
memory does not climb with the offered load. A re-submission after a shard was lost or
restarted (AddRequest.resubmitted) is always taken: it was admitted once and its client waits.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmserve.errors import OverloadedError, UnavailableError

if TYPE_CHECKING:
    from scheduler_service.fleet.fleet import Fleet

# Seconds a refused gateway's client is told to wait: about one request's time.
RETRY_AFTER_S = 1.0
DEFAULT_MAX_WAITING_REQUESTS = 4096


def num_waiting(fleet: Fleet) -> int:
    """Requests admitted and not yet running, across the fleet."""
    queued = sum(
        len(replica.engine.scheduler.waiting)
        for replica in fleet.replicas
        if replica.engine is not None
    )
    return queued + len(fleet.pending)


class SchedulerAdmission:
    """The bounded queue and the drain flag; `check` raises the refusal."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING_REQUESTS) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting_requests: must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.draining = False
        self.num_refused = 0

    def check(self, fleet: Fleet, resubmission: bool) -> None:
        if self.draining:
            self.num_refused += 1
            raise UnavailableError("the scheduler is shutting down")
        if resubmission:
            return
        waiting = num_waiting(fleet)
        if waiting >= self.max_waiting:
            self.num_refused += 1
            raise OverloadedError(
                f"the scheduler has {waiting} requests waiting, its limit "
                "(--max-waiting-requests); retry later",
                RETRY_AFTER_S,
            )


def arm_deadline(
    timeout_ms: int, key: str, route: object, expire: Callable[[str, object], None]
) -> None:
    """Call `expire(key, route)` after `timeout_ms`, unless `route` is gone by then (the
    timer holds only a weak reference, so a finished request is freed at once)."""
    ref = weakref.ref(route)

    def fire() -> None:
        target = ref()
        if target is not None:
            expire(key, target)

    asyncio.get_running_loop().call_later(timeout_ms / 1000, fire)


async def drain(
    num_unfinished: Callable[[], int], grace_s: float, poll_s: float = 0.1
) -> tuple[int, int]:
    """Wait up to `grace_s` for the requests in flight to finish. Returns (finished, left)."""
    start = num_unfinished()
    deadline = time.monotonic() + grace_s
    while num_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    left = num_unfinished()
    return max(start - left, 0), left
