"""The gateway's one long-lived Connect stream to the scheduler, multiplexing many requests.

`submit()` sends AddRequest and yields that request's SchedulerMessages until it finishes;
closing the iterator early (client cancel, stop string) sends Abort. If the stream breaks, every
request in flight gets an UNAVAILABLE error and the client reconnects in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from llmserve.grpc_utils import RequestError, channel_options
from llmserve.logs import get_logger
from llmserve.proto_convert import sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

_RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class SchedulerClient:
    """Owns the Connect stream; safe to use from many concurrent request handlers."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._outbox: asyncio.Queue[scheduler_pb2.GatewayMessage | None] = asyncio.Queue()
        self._inboxes: dict[str, asyncio.Queue[scheduler_pb2.SchedulerMessage]] = {}
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self._stub

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-stream")

    async def wait_connected(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    async def _outgoing(self) -> AsyncIterator[scheduler_pb2.GatewayMessage]:
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            yield message

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._channel.channel_ready()
                call = self._stub.Connect(self._outgoing())
                self._connected.set()
                attempt = 0
                log.info("connected to scheduler", address=self.address)
                async for message in call:
                    self._dispatch(message)
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                    "scheduler closed the stream",
                )
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                was_connected = self._connected.is_set()
                self._connected.clear()
                self._fail_all(f"scheduler stream lost: {exc.details() or exc.code().name}")
                self._outbox = asyncio.Queue()
                delay = _RECONNECT_DELAYS_S[min(attempt, len(_RECONNECT_DELAYS_S) - 1)]
                attempt += 1
                log.warning(
                    "scheduler unavailable, retrying" if not was_connected
                    else "scheduler stream lost, reconnecting",
                    address=self.address, retry_in_s=delay, code=exc.code().name,
                )
                await asyncio.sleep(delay)

    def _dispatch(self, message: scheduler_pb2.SchedulerMessage) -> None:
        kind = message.WhichOneof("kind")
        request_id = message.output.request_id if kind == "output" else message.error.request_id
        inbox = self._inboxes.get(request_id)
        if inbox is not None:
            inbox.put_nowait(message)

    def _fail_all(self, reason: str) -> None:
        for request_id, inbox in self._inboxes.items():
            inbox.put_nowait(
                scheduler_pb2.SchedulerMessage(
                    error=scheduler_pb2.RequestError(
                        request_id=request_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                        message=reason,
                    )
                )
            )

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        traceparent: str = "",
    ) -> AsyncGenerator[scheduler_pb2.RequestOutput, None]:
        """Yield the request's outputs until the finished one; raise RequestError on failure."""
        if not self._connected.is_set():
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, f"scheduler at {self.address} is not reachable"
            )
        if request_id in self._inboxes:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running",
                "request_id",
            )
        inbox: asyncio.Queue[scheduler_pb2.SchedulerMessage] = asyncio.Queue()
        self._inboxes[request_id] = inbox
        add = scheduler_pb2.AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params_to_proto(params),
            traceparent=traceparent,
        )
        if eos_token_id is not None:
            add.eos_token_id = eos_token_id
        finished = False
        try:
            self._outbox.put_nowait(scheduler_pb2.GatewayMessage(add=add))
            while not finished:
                message = await inbox.get()
                if message.WhichOneof("kind") == "error":
                    finished = True
                    error = message.error
                    code = _status_code(error.code)
                    raise RequestError(code, error.message, error.field or None)
                finished = message.output.finished
                yield message.output
        finally:
            del self._inboxes[request_id]
            if not finished and self._connected.is_set():
                self._outbox.put_nowait(
                    scheduler_pb2.GatewayMessage(
                        abort=scheduler_pb2.AbortRequest(request_id=request_id)
                    )
                )


def _status_code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
