"""SchedulerClient across a scheduler restart, against a fake scheduler served over real gRPC
(tests/support/fake_connect.py: token ids from a formula, one token per choice each time the
test calls `step()`, so what a client has received at any moment is known exactly).
"Restarting" the scheduler stops its gRPC server (every stream breaks) and serves a fresh fake,
with no memory of the old one, on the same port.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput, Prompt
from gateway.inflight import MAX_BATCH, MAX_BATCH_PROMPT_TOKENS, take_batch
from gateway.scheduler_client import SchedulerClient
from gateway.tokenization import Tokenization
from llmserve.proto_convert import sampling_params_from_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import common_pb2, scheduler_pb2
from tests.support.fake_connect import (
    STOP_TOKEN,
    FakeServer,
    Received,
    consume,
    logprob_of,
    token_at,
    until,
)

REQUESTS = {
    "single": SamplingParams(temperature=0.0, max_tokens=6),
    "pair-logprobs": SamplingParams(
        n=2, temperature=0.7, seed=5, max_tokens=7, logprobs=1, prompt_logprobs=0
    ),
    "best-of": SamplingParams(n=1, best_of=2, temperature=0.7, seed=9, max_tokens=5),
}
PROMPTS = {"single": [11, 12, 13], "pair-logprobs": [21, 22], "best-of": [31, 32, 33, 34]}


def run(
    test: Callable[[FakeServer, SchedulerClient], Awaitable[None]],
    reconnect_timeout_s: float = 60.0,
) -> None:
    async def main() -> None:
        server = FakeServer()
        await server.start()
        client = SchedulerClient(server.address, 1 << 20, reconnect_timeout_s)
        client.start()
        try:
            await client.wait_connected(30)
            await test(server, client)
        finally:
            await client.close()
            await server.stop()

    asyncio.run(main())


async def start_requests(client: SchedulerClient) -> dict[str, Received]:
    got = {name: Received() for name in REQUESTS}
    for name, params in REQUESTS.items():
        stream = client.submit(name, PROMPTS[name], params, eos_token_id=None)
        asyncio.create_task(consume(stream, got[name]))
    return got


async def run_to_end(server: FakeServer, got: dict[str, Received]) -> None:
    while not all(g.finished or g.error for g in got.values()):
        server.fake.step()
        await asyncio.sleep(0.01)


def reference_run() -> dict[str, Received]:
    result: dict[str, Received] = {}

    async def test(server: FakeServer, client: SchedulerClient) -> None:
        got = await start_requests(client)
        await until(lambda: len(server.fake.requests) == len(REQUESTS), "all added")
        await run_to_end(server, got)
        result.update(got)
        assert not any(add.resubmitted for add in server.fake.adds)  # each a first submission

    run(test)
    return result


def test_restart_mid_stream_gives_the_uninterrupted_stream():
    expected = reference_run()
    sent_again: list[scheduler_pb2.AddRequest] = []
    delivered: dict[str, dict[int, list[int]]] = {}

    async def test(server: FakeServer, client: SchedulerClient) -> None:
        got = await start_requests(client)
        await until(lambda: len(server.fake.requests) == len(REQUESTS), "all added")
        # Waits on tokens, not messages: outputs that reach a consumer together come merged.
        for step in range(3):
            server.fake.step()
            await until(
                lambda s=step: len(got["single"].tokens.get(0, [])) == s + 1, "step delivered"
            )
        pair = got["pair-logprobs"]
        await until(
            lambda: (
                pair.prompt_logprob_messages == 1
                and [len(pair.tokens.get(i, [])) for i in (0, 1)] == [3, 3]
            ),
            "prompt logprobs + 3 steps",
        )
        delivered.update(
            {name: {i: list(t) for i, t in g.tokens.items()} for name, g in got.items()}
        )
        await server.stop()
        await until(lambda: not client.connected, "stream loss noticed")
        await server.start()
        await until(lambda: len(server.fake.adds) == len(REQUESTS), "all sent again")
        sent_again.extend(server.fake.adds)
        await run_to_end(server, got)
        assert [g.error for g in got.values()] == [None] * len(got)
        for name, g in got.items():
            assert g.tokens == expected[name].tokens, name
            assert g.logprobs == expected[name].logprobs, name
            assert g.finish == expected[name].finish, name
            assert g.prompt_logprob_messages == expected[name].prompt_logprob_messages, name

    run(test)
    by_id = {add.request_id: add for add in sent_again}
    # Streaming requests continue with exactly what their consumer received (3 tokens each).
    assert delivered["single"] == {0: [token_at(PROMPTS["single"], 0, k) for k in range(3)]}
    single = by_id["single"].continuation
    assert [(c.index, list(c.token_ids)) for c in single.choices] == [(0, delivered["single"][0])]
    pair = by_id["pair-logprobs"].continuation
    assert [(c.index, list(c.token_ids)) for c in pair.choices] == sorted(
        delivered["pair-logprobs"].items()
    )
    assert [len(c.logprobs) for c in pair.choices] == [3, 3]
    assert pair.choices[1].cumulative_logprob == pytest.approx(
        sum(logprob_of(t) for t in delivered["pair-logprobs"][1])
    )
    # best_of > n streams nothing: it starts over from the prompt.
    assert delivered["best-of"] == {}
    assert not by_id["best-of"].HasField("continuation")
    # Every one is marked: the new stream's waiting-queue limit must not refuse it.
    assert all(add.resubmitted for add in sent_again)
    for add in sent_again:
        assert list(add.prompt_token_ids) == PROMPTS[add.request_id]
        assert sampling_params_from_proto(add.sampling_params) == REQUESTS[add.request_id]


async def consume_the_rest(
    server: FakeServer,
    client: SchedulerClient,
    first: scheduler_pb2.RequestOutput,
    slow: AsyncIterator[scheduler_pb2.RequestOutput],
    got: Received,
) -> None:
    """Consume `slow` (whose `first` message was taken) once everything the fake has sent it
    waits in its inbox: the Connect stream delivers in order, so that holds once a request
    sent after it has run to its end."""
    probe = {"single": Received()}
    stream = client.submit("single", PROMPTS["single"], REQUESTS["single"], eos_token_id=None)
    asyncio.create_task(consume(stream, probe["single"]))
    await until(lambda: "single" in server.fake.requests, "probe added")
    await run_to_end(server, probe)

    async def resumed() -> AsyncIterator[scheduler_pb2.RequestOutput]:
        yield first
        async for out in slow:
            yield out

    await consume(resumed(), got)


def test_outputs_queued_behind_a_slow_consumer_reach_it_as_one_message():
    expected = reference_run()["pair-logprobs"]
    got = Received()

    async def test(server: FakeServer, client: SchedulerClient) -> None:
        name = "pair-logprobs"
        slow = client.submit(name, PROMPTS[name], REQUESTS[name], eos_token_id=None)
        first = await anext(slow)  # sent; its first message is the prompt logprobs
        while server.fake.requests:
            server.fake.step()  # the request runs to its end while nobody reads it
        await consume_the_rest(server, client, first, slow, got)

    run(test)
    assert expected.messages > 2
    assert got.messages == 2  # the prompt logprobs, then everything else at once
    assert got.tokens == expected.tokens
    assert got.logprobs == expected.logprobs
    assert got.finish == expected.finish
    assert got.prompt_logprob_messages == expected.prompt_logprob_messages == 1
    assert got.finished


def test_an_error_queued_behind_outputs_comes_after_them():
    got = Received()

    async def test(server: FakeServer, client: SchedulerClient) -> None:
        slow = client.submit("r", [4], REQUESTS["single"], eos_token_id=None)
        first = asyncio.create_task(anext(slow))
        await until(lambda: "r" in server.fake.requests, "added")
        server.fake.step()
        head = await first
        for _ in range(2):
            server.fake.step()
        server.fake.requests.pop("r").outbox.put_nowait(
            scheduler_pb2.SchedulerMessage(
                error=scheduler_pb2.RequestError(request_id="r", code=13, message="worker lost")
            )
        )
        await consume_the_rest(server, client, head, slow, got)

    run(test)
    assert got.tokens == {0: [token_at([4], 0, k) for k in range(3)]}
    assert got.messages == 2  # the two queued outputs as one, then the error
    assert got.error is not None and got.error.grpc_code == grpc.StatusCode.INTERNAL


def test_finished_choice_is_continued_as_finished():
    sent_again: list[scheduler_pb2.AddRequest] = []

    async def test(server: FakeServer, client: SchedulerClient) -> None:
        params = SamplingParams(n=2, temperature=0.7, seed=1, max_tokens=3)
        got = Received()
        task = asyncio.create_task(consume(client.submit("r", [5, 6], params, None), got))
        await until(lambda: "r" in server.fake.requests, "added")
        for _ in range(2):  # choice 1 (2 tokens) finishes with the stop token
            server.fake.step()
        await until(lambda: 1 in got.finish, "choice 1 finished")
        await server.stop()
        await server.start()
        await until(lambda: len(server.fake.adds) == 1, "sent again")
        sent_again.extend(server.fake.adds)
        server.fake.step()
        await task
        assert got.tokens == {
            0: [token_at([5, 6], 0, k) for k in range(3)],
            1: [token_at([5, 6], 1, 0), STOP_TOKEN],
        }

    run(test)
    choices = sent_again[0].continuation.choices
    assert [c.finish_reason for c in choices] == [0, common_pb2.FINISH_REASON_STOP]
    assert choices[1].stop_token_id == STOP_TOKEN
    assert not choices[0].HasField("stop_token_id")


def test_scheduler_that_does_not_come_back_fails_with_unavailable():
    async def test(server: FakeServer, client: SchedulerClient) -> None:
        got = Received()
        task = asyncio.create_task(
            consume(client.submit("r", [1, 2], REQUESTS["single"], None), got)
        )
        await until(lambda: "r" in server.fake.requests, "added")
        server.fake.step()
        await until(lambda: got.messages == 1, "first token")
        await server.stop()
        await task
        assert got.error is not None
        assert got.error.grpc_code == grpc.StatusCode.UNAVAILABLE
        assert "did not come back within 0.3 s" in str(got.error)
        # A request that arrives while the scheduler is away waits, then fails the same way.
        late = Received()
        await consume(client.submit("late", [3], REQUESTS["single"], None), late)
        assert late.error is not None and late.error.grpc_code == grpc.StatusCode.UNAVAILABLE
        await server.start()
        await until(lambda: client.connected, "reconnected")
        assert server.fake.adds == []  # failed requests are not sent again

    run(test, reconnect_timeout_s=0.3)


def test_requests_aborted_while_disconnected_are_not_sent_again():
    async def test(server: FakeServer, client: SchedulerClient) -> None:
        kept, dropped = Received(), Received()
        kept_task = asyncio.create_task(
            consume(client.submit("kept", [1, 2], REQUESTS["single"], None), kept)
        )
        dropped_stream = client.submit("dropped", [3, 4], REQUESTS["single"], None)
        dropped_task = asyncio.create_task(consume(dropped_stream, dropped))
        await until(lambda: len(server.fake.requests) == 2, "added")
        server.fake.step()
        await until(lambda: kept.messages == dropped.messages == 1, "first tokens")
        await server.stop()
        await until(lambda: not client.connected, "stream loss noticed")
        dropped_task.cancel()  # the client goes away while the scheduler is down
        await asyncio.gather(dropped_task, return_exceptions=True)
        await dropped_stream.aclose()
        await server.start()
        await until(lambda: len(server.fake.adds) == 1, "sent again")
        assert [a.request_id for a in server.fake.adds] == ["kept"]
        while not kept.finished:
            server.fake.step()
            await asyncio.sleep(0.01)
        await kept_task
        assert server.fake.aborts == []  # nothing to abort on the new scheduler

    run(test)


def test_request_submitted_while_disconnected_is_sent_on_reconnect():
    async def test(server: FakeServer, client: SchedulerClient) -> None:
        await server.stop()
        await until(lambda: not client.connected, "stream loss noticed")
        got = Received()
        task = asyncio.create_task(consume(client.submit("r", [7], REQUESTS["single"], None), got))
        await server.start()
        await until(lambda: "r" in server.fake.requests, "sent once connected")
        while not got.finished:
            server.fake.step()
            await asyncio.sleep(0.01)
        await task
        assert got.tokens == {0: [token_at([7], 0, k) for k in range(6)]}
        assert not server.fake.adds[0].HasField("continuation")
        assert not server.fake.adds[0].resubmitted  # its first send

    run(test)


def test_error_from_the_new_scheduler_is_delivered():
    async def test(server: FakeServer, client: SchedulerClient) -> None:
        got = Received()
        task = asyncio.create_task(consume(client.submit("r", [1], REQUESTS["single"], None), got))
        await until(lambda: "r" in server.fake.requests, "added")
        await server.stop()
        await server.start()
        await until(lambda: "r" in server.fake.requests, "sent again")
        request = server.fake.requests.pop("r")
        request.outbox.put_nowait(
            scheduler_pb2.SchedulerMessage(
                error=scheduler_pb2.RequestError(
                    request_id="r",
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    message="continuation.choices.index: 3 is not below n=1",
                    field="continuation.choices.index",
                )
            )
        )
        await task
        assert got.error is not None and got.error.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert got.error.field == "continuation.choices.index"

    run(test)


# -- through GenerationCore: text, seeds ---------------------------------------------------------


def test_generation_text_is_unchanged_by_a_restart_and_sampling_gets_a_seed(smollm2_tokenizer):
    prompt = Prompt([101, 102, 103])
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=8),
        "sampled": SamplingParams(n=2, temperature=0.8, max_tokens=8),
        "seeded": SamplingParams(temperature=0.8, seed=42, max_tokens=8),
        "beam": SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=8),
    }

    def outputs(restart: bool) -> tuple[dict[str, dict[int, tuple[str, list[int]]]], list]:
        text: dict[str, dict[int, str]] = {name: {} for name in cases}
        tokens: dict[str, dict[int, list[int]]] = {name: {} for name in cases}
        updates = dict.fromkeys(cases, 0)
        adds: list[scheduler_pb2.AddRequest] = []

        async def test(server: FakeServer, client: SchedulerClient) -> None:
            core = GenerationCore("m", Tokenization(smollm2_tokenizer), client, 4096)

            async def one(name: str) -> None:
                inp = GenerationInput(name, prompt, cases[name])
                async for update in core.generate(inp):
                    updates[name] += 1
                    for c in update.choices:
                        text[name][c.index] = text[name].get(c.index, "") + c.text
                        tokens[name].setdefault(c.index, []).extend(c.token_ids)

            tasks = [asyncio.create_task(one(name)) for name in cases]
            await until(lambda: len(server.fake.requests) == len(cases), "all added")
            adds.extend(server.fake.adds)
            for step in range(3):
                server.fake.step()
                await until(lambda s=step: updates["greedy"] == s + 1, "step delivered")
            if restart:
                await server.stop()
                await server.start()
                await until(lambda: len(server.fake.requests) == len(cases), "all sent again")
            while server.fake.requests:
                server.fake.step()
                await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)

        run(test)
        merged = {name: {i: (text[name][i], tokens[name][i]) for i in text[name]} for name in cases}
        return merged, adds

    expected, adds = outputs(restart=False)
    got, _ = outputs(restart=True)
    assert got == expected
    assert [len(expected[name]) for name in cases] == [1, 2, 1, 1]
    assert len(expected["greedy"][0][1]) == 8
    seeds = {
        a.request_id: (a.sampling_params.seed if a.sampling_params.HasField("seed") else None)
        for a in adds
    }
    assert seeds["greedy"] is None and seeds["beam"] is None
    assert seeds["seeded"] == 42
    assert seeds["sampled"] is not None and 0 <= seeds["sampled"] < 2**63


def test_requests_queued_together_go_in_one_write():
    async def test(server: FakeServer, client: SchedulerClient) -> None:
        got = await start_requests(client)  # three submits in one turn of the event loop
        await until(lambda: len(server.fake.requests) == len(REQUESTS), "all added")
        assert server.fake.writes == 1
        await run_to_end(server, got)

    run(test)


def test_a_write_takes_what_is_queued_within_its_limits():
    def add(request_id: str, tokens: int) -> scheduler_pb2.GatewayMessage:
        return scheduler_pb2.GatewayMessage(
            add=scheduler_pb2.AddRequest(request_id=request_id, prompt_token_ids=[1] * tokens)
        )

    outbox: asyncio.Queue = asyncio.Queue()
    for i in range(MAX_BATCH + 2):
        outbox.put_nowait(add(f"r{i}", 1))
    outbox.put_nowait(None)
    first = take_batch(outbox.get_nowait(), outbox)
    assert [m.add.request_id for m in first.batch.messages] == [f"r{i}" for i in range(MAX_BATCH)]
    second = take_batch(outbox.get_nowait(), outbox)
    assert [m.add.request_id for m in second.batch.messages] == ["r256", "r257"]
    assert outbox.get_nowait() is None and outbox.empty()  # the end stays last
    # One message alone is sent as it is; prompt tokens end a batch once past the limit.
    assert take_batch(add("solo", 3), asyncio.Queue()).WhichOneof("kind") == "add"
    for name in ("a", "b", "c"):
        outbox.put_nowait(add(name, MAX_BATCH_PROMPT_TOKENS // 2))
    batch = take_batch(add("first", 1), outbox)
    assert [m.add.request_id for m in batch.batch.messages] == ["first", "a", "b"]
    assert outbox.get_nowait().add.request_id == "c"
