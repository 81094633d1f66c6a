"""When a lost replica tries its worker again.

After a loss the replica waits, then reconnects (`Replica._run`) and starts with a fresh
engine: the worker drops the sequence state of a closed stream, so a restarted worker at the
same address comes back. The waits grow (RETRY_DELAYS_S, the last one repeating), and a
RegisterWorker from that address ends the current one (`Reconnect.registered`): the worker
says it is up, so the delays start over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from llmserve import security
from llmserve.grpc_utils import PROMPT_RECONNECT, channel_options
from llmserve.logs import get_logger

log = get_logger(__name__)

RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0)


def worker_channel(address: str, max_message_bytes: int) -> grpc.aio.Channel:
    """The replica's channel to its worker, reconnecting promptly, so that a worker that comes
    back is reached at the next attempt."""
    options = [*channel_options(max_message_bytes), *PROMPT_RECONNECT]
    return security.aio_channel(address, options=options)


class Reconnect:
    """One replica's waits between attempts to connect to its worker."""

    def __init__(self) -> None:
        self._failures = 0  # attempts failed since the last connection or registration
        self._registered = asyncio.Event()

    def registered(self) -> None:
        """The worker registered: the wait in progress, or the next one, ends at once."""
        self._registered.set()

    def connecting(self) -> None:
        """An attempt starts: registrations before it have done their part."""
        self._registered.clear()

    def connected(self) -> None:
        self._failures = 0

    async def wait(self, replica_id: int, address: str, reason: str, refused: bool) -> None:
        """Log the failed attempt (`refused`: the worker refused its configuration), then wait
        the next delay or until the worker registers."""
        delay = RETRY_DELAYS_S[min(self._failures, len(RETRY_DELAYS_S) - 1)]
        self._failures += 1
        level, why = (
            (logging.ERROR, "worker refused its configuration, retrying")
            if refused
            else (logging.WARNING, "worker not reachable, retrying")
        )
        log.log(level, why, replica=replica_id, address=address, reason=reason, retry_in_s=delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._registered.wait(), delay)
            self._failures = 0
