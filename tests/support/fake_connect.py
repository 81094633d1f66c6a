"""A fake Scheduler Connect service over real gRPC, for gateway tests: it generates token ids
from a formula, one token per choice each time the test calls `step()`, so what a client has
received at any moment is known exactly. `FakeServer` can be stopped and served again ("a
restarted scheduler", with no memory of the old one) on the same port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from llmserve.errors import ApiError
from llmserve.proto_convert import sampling_params_from_proto
from llmserve.resubmission import continuation_from_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

STOP_TOKEN = 2


def token_at(prompt: list[int], seq: int, position: int) -> int:
    return (sum(prompt) * 31 + seq * 17 + position * 7) % 97 + 3


def logprob_of(token: int) -> float:
    return -(token % 5) / 4.0


def choice_length(params: SamplingParams, seq: int) -> int:
    return params.max_tokens - seq  # choices end at different steps


@dataclass
class _Seq:
    index: int
    tokens: list[int] = field(default_factory=list)
    cumulative: float = 0.0
    finished: bool = False


@dataclass
class _FakeRequest:
    add: scheduler_pb2.AddRequest
    params: SamplingParams
    seqs: list[_Seq]
    outbox: asyncio.Queue[scheduler_pb2.SchedulerMessage | None]


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Choice `i` of a prompt is token_at(prompt, i, 0), token_at(prompt, i, 1), ...; it has
    max_tokens - i tokens and ends with STOP_TOKEN (finish STOP) when i is odd, by LENGTH
    otherwise. Non-streaming requests (best_of > n) answer the best n of best_of at the end."""

    def __init__(self) -> None:
        self.adds: list[scheduler_pb2.AddRequest] = []
        self.aborts: list[str] = []
        self.requests: dict[str, _FakeRequest] = {}
        self.connected = asyncio.Event()
        self.writes = 0  # messages read off Connect streams (a batch counts once)

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.GatewayMessage], context: object
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        outbox: asyncio.Queue[scheduler_pb2.SchedulerMessage | None] = asyncio.Queue()

        async def read() -> None:
            async for received in request_iterator:
                self.writes += 1
                batch = received.WhichOneof("kind") == "batch"
                for message in received.batch.messages if batch else [received]:
                    if message.WhichOneof("kind") == "add":
                        self._add(message.add, outbox)
                    else:
                        self.aborts.append(message.abort.request_id)
                        self.requests.pop(message.abort.request_id, None)

        reader = asyncio.create_task(read())
        self.connected.set()
        try:
            while (message := await outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()

    def _add(self, add: scheduler_pb2.AddRequest, outbox: asyncio.Queue) -> None:
        self.adds.append(add)
        params = sampling_params_from_proto(add.sampling_params)
        seqs = [_Seq(i) for i in range(params.num_sampled)]
        for c in continuation_from_proto(add.continuation, params):
            seqs[c.index] = _Seq(c.index, c.token_ids, c.cumulative_logprob, bool(c.finish_reason))
        request = _FakeRequest(add, params, seqs, outbox)
        self.requests[add.request_id] = request
        if params.prompt_logprobs is not None:  # sent again on a re-submission, as may happen
            out = scheduler_pb2.RequestOutput(request_id=add.request_id)
            for position in range(1, len(add.prompt_token_ids)):
                out.prompt_logprobs.add(position=position).token.token_id = add.prompt_token_ids[
                    position
                ]
            outbox.put_nowait(scheduler_pb2.SchedulerMessage(output=out))

    def step(self) -> None:
        """One token for every unfinished choice of every request; one message per request."""
        for request_id, request in list(self.requests.items()):
            out = scheduler_pb2.RequestOutput(request_id=request_id)
            for seq in request.seqs:
                if not seq.finished:
                    delta = self._advance(request, seq)
                    if request.params.streams_choices:
                        out.choices.append(delta)
            out.finished = all(s.finished for s in request.seqs)
            if out.finished:
                del self.requests[request_id]
                if not request.params.streams_choices:
                    out.choices.extend(_final_choices(request))
            if out.choices or out.finished:
                request.outbox.put_nowait(scheduler_pb2.SchedulerMessage(output=out))

    def _advance(self, request: _FakeRequest, seq: _Seq) -> scheduler_pb2.ChoiceDelta:
        params = request.params
        length = choice_length(params, seq.index)
        last = len(seq.tokens) == length - 1
        stop = last and seq.index % 2 == 1
        token = (
            STOP_TOKEN
            if stop
            else token_at(list(request.add.prompt_token_ids), seq.index, len(seq.tokens))
        )
        seq.tokens.append(token)
        seq.cumulative += logprob_of(token)
        seq.finished = last
        delta = scheduler_pb2.ChoiceDelta(
            index=seq.index, token_ids=[token], cumulative_logprob=seq.cumulative
        )
        if params.logprobs is not None:
            delta.logprobs.add(
                token=common_pb2.TokenLogprob(token_id=token, logprob=logprob_of(token), rank=1)
            )
        if last:
            delta.finish_reason = (
                common_pb2.FINISH_REASON_STOP if stop else common_pb2.FINISH_REASON_LENGTH
            )
            if stop:
                delta.stop_token_id = STOP_TOKEN
        return delta


def _final_choices(request: _FakeRequest) -> list[scheduler_pb2.ChoiceDelta]:
    best = sorted(request.seqs, key=lambda s: s.cumulative, reverse=True)[: request.params.n]
    return [
        scheduler_pb2.ChoiceDelta(index=rank, token_ids=s.tokens, cumulative_logprob=s.cumulative)
        for rank, s in enumerate(best)
    ]


class FakeServer:
    """A FakeScheduler behind a real gRPC server that can be stopped and served again."""

    def __init__(self) -> None:
        self.port = 0
        self.fake = FakeScheduler()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.fake = FakeScheduler()  # a restarted scheduler remembers nothing
        self._server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.fake, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()

    async def stop(self) -> None:
        assert self._server is not None
        await self._server.stop(None)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for `condition` (set by other tasks); the bound only catches a hang."""
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


@dataclass
class Received:
    """What a consumer of `submit()` saw, flattened per choice."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finish: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    prompt_logprob_messages: int = 0
    messages: int = 0
    finished: bool = False
    error: ApiError | None = None


async def consume(stream: AsyncIterator[scheduler_pb2.RequestOutput], got: Received) -> None:
    try:
        async for out in stream:
            got.messages += 1
            got.prompt_logprob_messages += bool(out.prompt_logprobs)
            for c in out.choices:
                got.tokens.setdefault(c.index, []).extend(c.token_ids)
                got.logprobs.setdefault(c.index, []).extend(lp.token.logprob for lp in c.logprobs)
                if c.finish_reason:
                    stop = c.stop_token_id if c.HasField("stop_token_id") else None
                    got.finish[c.index] = (c.finish_reason, stop)
            got.finished = out.finished
    except ApiError as exc:
        got.error = exc
