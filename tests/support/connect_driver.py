"""A gateway's minimum, for tests and benchmarks that drive a scheduler without one: one
Connect stream, token-id requests in, each request's outputs recorded as they arrive.

    async with ConnectDriver(address) as driver:
        driver.submit("r0", [1, 2, 3], max_tokens=8, ignore_eos=True)
        await driver.wait_all(timeout_s=30)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.inflight import outgoing, unbatched
from llmserve.grpc_utils import channel_options
from llmserve.proto_convert import sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc


@dataclass
class Tracked:
    """One request as the driver saw it (times from time.perf_counter())."""

    request_id: str
    sent: float
    first_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    # Output messages received (a stream interval gathers several tokens in one).
    num_outputs: int = 0
    # Per choice index (kept when the driver keeps tokens).
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, int] = field(default_factory=dict)
    stop_token_ids: dict[int, int] = field(default_factory=dict)
    error: str | None = None
    # The scheduler's own timings of the request (RequestMetrics), from arrival there.
    scheduler_first_token_ns: int | None = None
    scheduler_e2e_ns: int | None = None

    @property
    def done(self) -> bool:
        return self.finished is not None or self.error is not None


class ConnectDriver:
    """`on_done(tracked)` runs when a request finishes or fails (a closed loop submits its
    successor there). `keep_tokens=False` only counts tokens (benchmarks)."""

    def __init__(
        self,
        address: str,
        on_done: Callable[[Tracked], None] | None = None,
        keep_tokens: bool = True,
    ) -> None:
        self.address = address
        self.on_done = on_done
        self.keep_tokens = keep_tokens
        self.requests: dict[str, Tracked] = {}
        self.num_tokens = 0  # output tokens received, all requests
        self._outbox: asyncio.Queue[scheduler_pb2.GatewayMessage | None] = asyncio.Queue()
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __aenter__(self) -> ConnectDriver:
        self._channel = grpc.aio.insecure_channel(self.address, options=channel_options())
        stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._call = stub.Connect(outgoing(self._outbox))  # batched, as a gateway writes
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._channel.close()

    def submit(self, request_id: str, prompt: list[int], **sampling: Any) -> Tracked:
        """Send one request; `sampling`: SamplingParams keywords."""
        add = scheduler_pb2.AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(SamplingParams(**sampling)),
        )
        tracked = self.requests[request_id] = Tracked(request_id, time.perf_counter())
        self._pending += 1
        self._idle.clear()
        self._outbox.put_nowait(scheduler_pb2.GatewayMessage(add=add))
        return tracked

    async def wait_all(self, timeout_s: float) -> None:
        """Until every submitted request is done; TimeoutError naming how many are not."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            raise TimeoutError(f"{self._pending} requests unfinished after {timeout_s} s") from None

    async def _read(self) -> None:
        async for received in self._call:
            now = time.perf_counter()
            for message in unbatched(received):
                self._on_message(message, now)

    def _on_message(self, message: scheduler_pb2.SchedulerMessage, now: float) -> None:
        if message.WhichOneof("kind") == "error":
            tracked = self.requests[message.error.request_id]
            tracked.error = f"{message.error.code}: {message.error.message}"
            self._done(tracked)
            return
        output = message.output
        tracked = self.requests[output.request_id]
        tracked.num_outputs += 1
        for choice in output.choices:
            n = len(choice.token_ids)
            if n and tracked.first_token is None:
                tracked.first_token = now
            tracked.num_tokens += n
            self.num_tokens += n
            if self.keep_tokens:
                tracked.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
            if choice.finish_reason:
                tracked.finish_reasons[choice.index] = choice.finish_reason
            if choice.HasField("stop_token_id"):
                tracked.stop_token_ids[choice.index] = choice.stop_token_id
        if output.finished:
            tracked.finished = now
            tracked.scheduler_first_token_ns = output.metrics.first_token_ns
            tracked.scheduler_e2e_ns = output.metrics.e2e_ns
            self._done(tracked)

    def _done(self, tracked: Tracked) -> None:
        self._pending -= 1
        if self.on_done is not None:
            self.on_done(tracked)
        if self._pending == 0:
            self._idle.set()
