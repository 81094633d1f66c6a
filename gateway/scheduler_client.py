"""The gateway's one long-lived Connect stream to the scheduler, multiplexing many requests.

`submit()` sends AddRequest and yields that request's SchedulerMessages until it finishes;
closing the iterator early (client cancel, stop string) sends Abort.

The stream breaking does not fail the requests in flight. The client keeps, per request, its
AddRequest and everything the scheduler sent for it; it reconnects in the background and sends
every unfinished request again, with a Continuation holding the tokens already received when
its choices stream, so the restarted scheduler sends only what is new and the consumers simply
go on. A request that waits longer than `reconnect_timeout_s` for a scheduler fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from llmserve import security
from llmserve.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    UnavailableError,
    from_status_value,
)
from llmserve.grammar.spec import GrammarSpec
from llmserve.grpc_utils import channel_options
from llmserve.logs import get_logger
from llmserve.proto_convert import grammar_to_proto, sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

_RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# gRPC's own reconnect backoff (used while channel_ready() waits) would grow to 120 s; a
# restarting scheduler should be found within about a second of it listening again.
_CHANNEL_BACKOFF = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
DEFAULT_RECONNECT_TIMEOUT_S = 60.0

_Inbox = asyncio.Queue[scheduler_pb2.SchedulerMessage]
_Outbox = asyncio.Queue[scheduler_pb2.GatewayMessage | None]


@dataclass(slots=True, eq=False)
class _InFlight:
    """A submitted request as this gateway knows it: enough to send it again."""

    add: scheduler_pb2.AddRequest
    inbox: _Inbox
    # Choices stream as they grow (no best_of > n, no beam search), so a re-submission can
    # continue them; the others restart from the prompt (their seed makes that reproduce).
    streams_choices: bool
    # Everything received so far, per choice index.
    choices: dict[int, scheduler_pb2.ContinuedChoice] = field(default_factory=dict)
    prompt_logprobs_received: bool = False
    # Its last message (finished output or error) was received: never sent again.
    done: bool = False
    # While it waits for a scheduler: fails it when the wait exceeds the timeout.
    expiry: asyncio.TimerHandle | None = None

    def record(self, output: scheduler_pb2.RequestOutput) -> None:
        if output.prompt_logprobs:
            self.prompt_logprobs_received = True
        self.done = output.finished
        if not self.streams_choices:
            return  # choices arrive only with the last message
        for delta in output.choices:
            choice = self.choices.get(delta.index)
            if choice is None:
                choice = self.choices[delta.index] = scheduler_pb2.ContinuedChoice(
                    index=delta.index
                )
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
            choice.cumulative_logprob = delta.cumulative_logprob
            if delta.finish_reason:
                choice.finish_reason = delta.finish_reason
            if delta.HasField("stop_token_id"):
                choice.stop_token_id = delta.stop_token_id

    def resubmission(self) -> scheduler_pb2.AddRequest:
        add = scheduler_pb2.AddRequest()
        add.CopyFrom(self.add)
        if self.choices:
            add.continuation.choices.extend(self.choices[i] for i in sorted(self.choices))
        return add

    def stop_waiting(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None


class SchedulerClient:
    """Owns the Connect stream; safe to use from many concurrent request handlers."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.reconnect_timeout_s = reconnect_timeout_s
        self._channel = security.aio_channel(
            address, options=[*channel_options(max_message_bytes), *_CHANNEL_BACKOFF]
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        # The live stream's outgoing queue; None while there is no stream.
        self._outbox: _Outbox | None = None
        self._requests: dict[str, _InFlight] = {}
        self._connected = asyncio.Event()
        self._ever_connected = False
        self._task: asyncio.Task[None] | None = None

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self._stub

    @property
    def num_requests(self) -> int:
        """Requests with state here (an inbox): submitted and not yet closed."""
        return len(self._requests)

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
        for request in self._requests.values():
            request.stop_waiting()
        await self._channel.close()

    # -- the stream ----------------------------------------------------------------------------

    @staticmethod
    async def _outgoing(outbox: _Outbox) -> AsyncIterator[scheduler_pb2.GatewayMessage]:
        while (message := await outbox.get()) is not None:
            yield message

    async def _run(self) -> None:
        attempt = 0
        while True:
            outbox: _Outbox = asyncio.Queue()
            try:
                await self._channel.channel_ready()
                call = self._stub.Connect(self._outgoing(outbox))
                self._on_connected(outbox, attempt)
                attempt = 0
                async for message in call:
                    self._dispatch(message)
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "scheduler closed the stream",
                )
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                was_connected = self._connected.is_set()
                self._on_disconnected(outbox)
                delay = _RECONNECT_DELAYS_S[min(attempt, len(_RECONNECT_DELAYS_S) - 1)]
                attempt += 1
                log.warning(
                    "scheduler stream lost, reconnecting"
                    if was_connected
                    else "scheduler unavailable, retrying",
                    address=self.address,
                    retry_in_s=delay,
                    code=exc.code().name,
                    details=exc.details(),
                    requests_waiting=self._num_unfinished(),
                )
                await asyncio.sleep(delay)

    def _on_connected(self, outbox: _Outbox, attempt: int) -> None:
        """Adopt a new stream and send every unfinished request on it."""
        self._outbox = outbox
        self._connected.set()
        resent = continued = 0
        for request in self._requests.values():
            if request.done:
                continue
            request.stop_waiting()
            add = request.resubmission()
            outbox.put_nowait(scheduler_pb2.GatewayMessage(add=add))
            resent += 1
            continued += add.HasField("continuation")
        if self._ever_connected:
            log.info(
                "reconnected to scheduler",
                address=self.address,
                attempts=attempt + 1,
                resubmitted=resent,
                continued=continued,
            )
        else:
            log.info("connected to scheduler", address=self.address)
        self._ever_connected = True

    def _on_disconnected(self, outbox: _Outbox) -> None:
        """Keep every request; each waits for the next stream, up to the timeout."""
        self._connected.clear()
        self._outbox = None
        outbox.put_nowait(None)  # ends the dead call's request iterator
        for request in self._requests.values():
            if not request.done and request.expiry is None:
                self._wait_for_scheduler(request)

    def _wait_for_scheduler(self, request: _InFlight) -> None:
        request.expiry = asyncio.get_running_loop().call_later(
            self.reconnect_timeout_s, self._expire, request
        )

    def _expire(self, request: _InFlight) -> None:
        request.expiry = None
        if request.done:
            return
        request.done = True
        request.inbox.put_nowait(
            scheduler_pb2.SchedulerMessage(
                error=scheduler_pb2.RequestError(
                    request_id=request.add.request_id,
                    code=grpc.StatusCode.UNAVAILABLE.value[0],
                    message=f"the scheduler at {self.address} did not come back within "
                    f"{self.reconnect_timeout_s:g} s (--scheduler-reconnect-timeout-s)",
                )
            )
        )

    def _num_unfinished(self) -> int:
        return sum(not r.done for r in self._requests.values())

    def _dispatch(self, received: scheduler_pb2.SchedulerMessage) -> None:
        for message in unbatched(received):
            self._dispatch_one(message)

    def _dispatch_one(self, message: scheduler_pb2.SchedulerMessage) -> None:
        kind = message.WhichOneof("kind")
        request_id = message.output.request_id if kind == "output" else message.error.request_id
        request = self._requests.get(request_id)
        if request is None or request.done:
            return
        if kind == "output":
            output = message.output
            if request.prompt_logprobs_received and output.prompt_logprobs:
                del output.prompt_logprobs[:]  # sent again after a re-submission
            request.record(output)
        else:
            request.done = True
        request.inbox.put_nowait(message)

    # -- requests ------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        traceparent: str = "",
        priority: int = 0,
        stop: Sequence[str] = (),
        decode_special_tokens: bool = False,
        timeout_s: float | None = None,
        grammar: GrammarSpec | None = None,
    ) -> AsyncGenerator[scheduler_pb2.RequestOutput, None]:
        """Yield the request's outputs until the finished one; raise the scheduler's error
        (an ApiError with its status code) on failure. With `stop` strings the scheduler
        finishes each choice at the token that completes one (its text decoded with special
        tokens when `decode_special_tokens`). With a `grammar` (checked by the caller) every
        choice's output matches it; a re-submission after a scheduler restart carries it too.

        While the scheduler is away (it was reached before), the request waits for it.
        With `timeout_s`, the scheduler is told the time left and the request fails with
        DeadlineExceededError (here or there, whichever notices first) when it runs out."""
        if not self._ever_connected:
            raise UnavailableError(f"scheduler at {self.address} is not reachable")
        if request_id in self._requests:
            raise AlreadyExistsError(f"request_id: {request_id!r} is already running", "request_id")
        add = scheduler_pb2.AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params_to_proto(params),
            traceparent=traceparent,
            priority=priority,
            stop=list(stop),
            decode_special_tokens=decode_special_tokens and bool(stop),
        )
        if grammar is not None:
            add.grammar.CopyFrom(grammar_to_proto(grammar))
        if eos_token_id is not None:
            add.eos_token_id = eos_token_id
        deadline = None
        if timeout_s is not None:
            add.timeout_ms = max(1, min(int(timeout_s * 1000), 2**32 - 1))
            deadline = asyncio.get_running_loop().time() + timeout_s
        request = _InFlight(add, asyncio.Queue(), params.streams_choices)
        self._requests[request_id] = request
        if self._outbox is not None:
            self._outbox.put_nowait(scheduler_pb2.GatewayMessage(add=add))
        else:
            self._wait_for_scheduler(request)
        try:
            while True:
                message = await _next(request.inbox, deadline, timeout_s)
                if message.WhichOneof("kind") == "error":
                    error = message.error
                    raise from_status_value(error.code, error.message, error.field or None)
                yield message.output
                if message.output.finished:
                    return
        finally:
            del self._requests[request_id]
            request.stop_waiting()
            # Not finished (client gone, stop strings): stop it. Without a stream there is
            # nothing to stop: leaving the in-flight set keeps it from being sent again.
            if not request.done and self._outbox is not None:
                self._outbox.put_nowait(
                    scheduler_pb2.GatewayMessage(
                        abort=scheduler_pb2.AbortRequest(request_id=request_id)
                    )
                )


async def _next(
    inbox: _Inbox, deadline: float | None, timeout_s: float | None
) -> scheduler_pb2.SchedulerMessage:
    if deadline is None:
        return await inbox.get()
    left = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(inbox.get(), max(left, 0.0))
    except TimeoutError:
        raise DeadlineExceededError(
            f"the request did not finish within its time limit of {timeout_s:g} s"
        ) from None


def unbatched(message: scheduler_pb2.SchedulerMessage) -> list[scheduler_pb2.SchedulerMessage]:
    """The outputs and errors a message read from a Connect stream carries, in order."""
    if message.WhichOneof("kind") == "batch":
        return list(message.batch.messages)
    return [message]
