"""The gateway's long-lived Connect streams to the scheduler shards, multiplexing many requests.

`submit()` sends AddRequest on one shard's stream and yields that request's SchedulerMessages
until it finishes; closing the iterator early (client cancel, stop string) sends Abort. With
one scheduler (the usual case) there is one shard; `--scheduler A,B,...` names several, each a
scheduler that owns its own workers (see `SchedulerClient` for how requests are placed).

A stream breaking does not fail the requests in flight. The client keeps, per request, its
AddRequest and everything the scheduler sent for it (`inflight.InFlight`), and sends every
unfinished request of the lost stream again, with a Continuation holding the tokens already
received when its choices stream: to another connected shard at once, or else to the first
shard that connects (a restarted scheduler). The scheduler that takes it sends only what is
new, and the consumers simply go on. A request that waits longer than `reconnect_timeout_s`
for a scheduler fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.inflight import Inbox, InFlight, Outbox, absorb, outgoing, unbatched
from gateway.shard_routing import pick_shard, prefix_key
from llmserve import security
from llmserve.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    UnavailableError,
    from_status_value,
)
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.grpc_utils import PROMPT_RECONNECT, channel_options
from llmserve.logs import get_logger
from llmserve.proto_convert import (
    grammar_to_proto,
    reasoning_to_proto,
    sampling_params_to_proto,
)
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

_RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)
DEFAULT_RECONNECT_TIMEOUT_S = 60.0


@dataclass(eq=False, slots=True)
class _Shard:
    """One scheduler shard and this gateway's Connect stream to it."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    # The live stream's outgoing queue; None while there is no stream.
    outbox: Outbox | None = None
    ever_connected: bool = False
    task: asyncio.Task[None] | None = None
    # Unfinished requests whose messages come from this shard's stream.
    requests: set[str] = field(default_factory=set)


class SchedulerClient:
    """Owns the Connect streams (one per scheduler shard); safe to use from many concurrent
    request handlers.

    With several shards, a new request goes to a connected shard chosen by
    `shard_routing.pick_shard` (its prompt's prefix, bounded by load), preferring shards that
    `is_serving` says have a ready worker. When a shard's stream breaks, its unfinished
    requests are re-submitted at once, as continuations, to the other connected shards; with
    none connected they wait, up to `reconnect_timeout_s`, for the first shard that connects.
    A shard left without a ready worker has its requests moved the same way
    (`move_off_idle_shards`)."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        max_message_bytes: int,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError(f"scheduler addresses must be distinct and given: {addresses!r}")
        self.address = ",".join(addresses)
        self.reconnect_timeout_s = reconnect_timeout_s
        # channel_ready() waits on gRPC's own reconnects: a restarting scheduler is found
        # within about a second of it listening again.
        options = [*channel_options(max_message_bytes), *PROMPT_RECONNECT]
        self._shards: dict[str, _Shard] = {}
        for address in addresses:
            channel = security.aio_channel(address, options=options)
            self._shards[address] = _Shard(
                address, channel, scheduler_pb2_grpc.SchedulerStub(channel)
            )
        # Whether a shard has a ready worker (the gateway's readiness watch sets this).
        self.is_serving: Callable[[str], bool] = lambda address: True
        self._requests: dict[str, InFlight] = {}
        self._connected = asyncio.Event()

    @property
    def num_requests(self) -> int:
        """Requests with state here (an inbox): submitted and not yet closed."""
        return len(self._requests)

    @property
    def connected(self) -> bool:
        """Whether the stream to at least one shard is up."""
        return self._connected.is_set()

    def shard_connected(self, address: str) -> bool:
        return self._shards[address].outbox is not None

    def shard_load(self, address: str) -> int:
        """Unfinished requests on the shard (those waiting for any shard are on none)."""
        return len(self._shards[address].requests)

    def start(self) -> None:
        for shard in self._shards.values():
            shard.task = asyncio.create_task(self._run(shard), name=f"scheduler-{shard.address}")

    async def wait_connected(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def close(self) -> None:
        tasks = [s.task for s in self._shards.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for request in self._requests.values():
            request.stop_waiting()
        for shard in self._shards.values():
            await shard.channel.close()

    # -- the streams ---------------------------------------------------------------------------

    async def _run(self, shard: _Shard) -> None:
        attempt = 0
        while True:
            outbox: Outbox = asyncio.Queue()
            try:
                await shard.channel.channel_ready()
                call = shard.stub.Connect(outgoing(outbox))
                self._on_connected(shard, outbox, attempt)
                attempt = 0
                async for message in call:
                    self._dispatch(shard, message)
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "scheduler closed the stream",
                )
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                was_connected = shard.outbox is outbox
                self._on_disconnected(shard, outbox)
                delay = _RECONNECT_DELAYS_S[min(attempt, len(_RECONNECT_DELAYS_S) - 1)]
                attempt += 1
                log.warning(
                    "scheduler stream lost, reconnecting"
                    if was_connected
                    else "scheduler unavailable, retrying",
                    address=shard.address,
                    retry_in_s=delay,
                    code=exc.code().name,
                    details=exc.details(),
                    requests_waiting=self._num_unfinished(),
                )
                await asyncio.sleep(delay)

    def _on_connected(self, shard: _Shard, outbox: Outbox, attempt: int) -> None:
        """Adopt a new stream and send every unfinished request that waits for a shard to a
        connected one (a serving one, if any: the shard that connects first may have no
        worker)."""
        shard.outbox = outbox
        self._connected.set()
        resent = continued = 0
        for request in self._requests.values():
            if request.done or request.shard is not None:
                continue
            target = self._choose(request.add.prompt_token_ids) or shard
            continued += self._send(request, target)
            resent += 1
        if shard.ever_connected:
            log.info(
                "reconnected to scheduler",
                address=shard.address,
                attempts=attempt + 1,
                resubmitted=resent,
                continued=continued,
            )
        else:
            log.info("connected to scheduler", address=shard.address, resubmitted=resent)
        shard.ever_connected = True

    def _on_disconnected(self, shard: _Shard, outbox: Outbox) -> None:
        """Move the shard's requests to another connected shard; with none, each waits for the
        next stream, up to the timeout."""
        shard.outbox = None
        outbox.put_nowait(None)  # ends the dead call's request iterator
        if not any(s.outbox is not None for s in self._shards.values()):
            self._connected.clear()
        moved = 0
        for request_id in list(shard.requests):
            request = self._requests[request_id]
            self._release(request)
            target = self._choose(request.add.prompt_token_ids)
            if target is None:
                self._wait_for_scheduler(request)
            else:
                self._send(request, target)
                moved += 1
        if moved:
            log.info("requests moved to other shards", address=shard.address, moved=moved)

    def move_off_idle_shards(self) -> int:
        """Move the requests of every connected shard without a ready worker (`is_serving`)
        to serving ones, when there are any: aborted there, re-submitted here as
        continuations. A shard that restarted empty gets no workers back, so requests placed
        on it (or re-submitted to it, the first shard to connect) would wait there for none.
        Returns how many moved. The readiness watch calls this when a shard's health
        changes."""
        connected = [s for s in self._shards.values() if s.outbox is not None]
        if not any(self.is_serving(s.address) for s in connected):
            return 0
        moved = 0
        for shard in connected:
            if self.is_serving(shard.address) or shard.outbox is None:
                continue
            moved_here = 0
            for request_id in list(shard.requests):
                request = self._requests[request_id]
                target = self._choose(request.add.prompt_token_ids)
                if request.done or target is None or target is shard:
                    continue
                self._release(request)
                shard.outbox.put_nowait(
                    scheduler_pb2.GatewayMessage(
                        abort=scheduler_pb2.AbortRequest(request_id=request_id)
                    )
                )
                self._send(request, target)
                moved_here += 1
            if moved_here:
                log.info("requests moved off a shard without a ready worker",
                         address=shard.address, moved=moved_here)  # fmt: skip
            moved += moved_here
        return moved

    def _choose(self, prompt_token_ids: Sequence[int]) -> _Shard | None:
        """The connected shard for a request (serving ones first); None if none is connected."""
        connected = [s for s in self._shards.values() if s.outbox is not None]
        candidates = [s for s in connected if self.is_serving(s.address)] or connected
        address = pick_shard(
            prefix_key(prompt_token_ids), {s.address: len(s.requests) for s in candidates}
        )
        return None if address is None else self._shards[address]

    def _send(self, request: InFlight, shard: _Shard) -> bool:
        """Send the request (again, with what it has received) on `shard`'s stream; returns
        whether it went as a continuation."""
        assert shard.outbox is not None
        request.stop_waiting()
        request.shard = shard.address
        shard.requests.add(request.add.request_id)
        add = request.resubmission()
        request.sent = True
        shard.outbox.put_nowait(scheduler_pb2.GatewayMessage(add=add))
        return add.HasField("continuation")

    def _release(self, request: InFlight) -> None:
        if request.shard is not None:
            self._shards[request.shard].requests.discard(request.add.request_id)
            request.shard = None

    def _wait_for_scheduler(self, request: InFlight) -> None:
        if request.expiry is None:
            request.expiry = asyncio.get_running_loop().call_later(
                self.reconnect_timeout_s, self._expire, request
            )

    def _expire(self, request: InFlight) -> None:
        request.expiry = None
        if request.done:
            return
        request.done = True
        request.inbox.put_nowait(
            scheduler_pb2.SchedulerMessage(
                error=scheduler_pb2.RequestError(
                    request_id=request.add.request_id,
                    code=grpc.StatusCode.UNAVAILABLE.value[0],
                    message=self._none_of("did not come back", "came back") + " within "
                    f"{self.reconnect_timeout_s:g} s (--scheduler-reconnect-timeout-s)",
                )
            )
        )

    def _none_of(self, one: str, several: str) -> str:
        """A sentence saying no scheduler does something, for one shard or several."""
        if len(self._shards) == 1:
            return f"the scheduler at {self.address} {one}"
        return f"no scheduler shard of {self.address} {several}"

    def _num_unfinished(self) -> int:
        return sum(not r.done for r in self._requests.values())

    def _dispatch(self, shard: _Shard, received: scheduler_pb2.SchedulerMessage) -> None:
        for message in unbatched(received):
            self._dispatch_one(shard, message)

    def _dispatch_one(self, shard: _Shard, message: scheduler_pb2.SchedulerMessage) -> None:
        kind = message.WhichOneof("kind")
        request_id = message.output.request_id if kind == "output" else message.error.request_id
        request = self._requests.get(request_id)
        # A message of a request that has moved to another shard is stale.
        if request is None or request.done or request.shard != shard.address:
            return
        if kind == "output":
            output = message.output
            if request.prompt_logprobs_received and output.prompt_logprobs:
                del output.prompt_logprobs[:]  # sent again after a re-submission
            request.record(output)
        else:
            request.done = True
        if request.done:
            self._release(request)
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
        reasoning: ReasoningSpec | None = None,
    ) -> AsyncGenerator[scheduler_pb2.RequestOutput, None]:
        """Yield the request's outputs until the finished one; raise the scheduler's error
        (an ApiError with its status code) on failure. With `stop` strings the scheduler
        finishes each choice at the token that completes one (its text decoded with special
        tokens when `decode_special_tokens`). With a `grammar` (checked by the caller) every
        choice's output matches it; a re-submission after a scheduler restart carries it too.
        With `reasoning` the scheduler follows the output's reasoning block (its budget; the
        grammar starts after it).

        While no scheduler is connected (one was reached before), the request waits for one.
        With `timeout_s`, the scheduler is told the time left and the request fails with
        DeadlineExceededError (here or there, whichever notices first) when it runs out."""
        if not any(s.ever_connected for s in self._shards.values()):
            raise UnavailableError(self._none_of("is not reachable", "is reachable"))
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
        if reasoning is not None:
            add.reasoning.CopyFrom(reasoning_to_proto(reasoning))
        if eos_token_id is not None:
            add.eos_token_id = eos_token_id
        deadline = None
        if timeout_s is not None:
            add.timeout_ms = max(1, min(int(timeout_s * 1000), 2**32 - 1))
            deadline = asyncio.get_running_loop().time() + timeout_s
        request = InFlight(add, asyncio.Queue(), params.streams_choices)
        self._requests[request_id] = request
        shard = self._choose(prompt_token_ids)
        if shard is not None:
            self._send(request, shard)
        else:
            self._wait_for_scheduler(request)
        try:
            held: scheduler_pb2.SchedulerMessage | None = None
            while True:
                if held is None:
                    message = await _next(request.inbox, deadline, timeout_s)
                else:
                    message, held = held, None
                if message.WhichOneof("kind") == "error":
                    error = message.error
                    raise from_status_value(error.code, error.message, error.field or None)
                output = message.output
                # Outputs that queued up behind this one (the consumer fell behind) go as one.
                while not output.finished and not request.inbox.empty():
                    later = request.inbox.get_nowait()
                    if later.WhichOneof("kind") != "output":
                        held = later  # an error: after what came before it
                        break
                    absorb(output, later.output)
                yield output
                if output.finished:
                    return
        finally:
            del self._requests[request_id]
            request.stop_waiting()
            # Not finished (client gone, stop strings): stop it where it runs. Without a
            # stream there is nothing to stop: leaving the in-flight set keeps it from being
            # sent again.
            outbox = None if request.shard is None else self._shards[request.shard].outbox
            self._release(request)
            if not request.done and outbox is not None:
                outbox.put_nowait(
                    scheduler_pb2.GatewayMessage(
                        abort=scheduler_pb2.AbortRequest(request_id=request_id)
                    )
                )


async def _next(
    inbox: Inbox, deadline: float | None, timeout_s: float | None
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
