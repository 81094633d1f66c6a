"""Admission, limits, bad input and deadlines against a live stack (worker, scheduler and
gateway as real processes, tiny random Llama): the scheduler's bounded queue refuses the
excess at once and every admitted request completes; malformed fields are 400s naming them;
an expired deadline frees its blocks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.inflight import unbatched
from llmserve.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.hardening import (
    blocks,
    gateway_gauges,
    grpc_request,
    http_body,
    is_idle,
    wait_idle,
)
from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

QUEUE_LIMIT = 8
# Sequences a step may run: with the queue limit, at most 4 + 8 requests are admitted at once.
MAX_SEQS = 4
TOKENS = 24
# The requests that fill the batch before a burst: most of the tiny model's context.
LONG_TOKENS = 480
PROMPT = "The capital of France is"
MAX_STOP_STRINGS = 3


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("admission-logs"),
        scheduler_args=[
            "--max-waiting-requests",
            str(QUEUE_LIMIT),
            "--max-num-seqs",
            str(MAX_SEQS),
        ],
        # A generous timeout on every request: it is passed on and must not hurt.
        gateway_args=[
            "--request-timeout-s",
            "120",
            "--max-stop-strings",
            str(MAX_STOP_STRINGS),
            "--max-body-bytes",
            "65536",
            "--max-prompts-per-request",
            "4",
        ],
    )
    yield running
    running.stop()


# -- backpressure ------------------------------------------------------------------------------


async def _http_one(client: httpx.AsyncClient, i: int) -> tuple[str, Any]:
    stream = i % 4 == 1
    body = http_body(f"{PROMPT} {i}", TOKENS, stream=stream)
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 200:
            return "ok", r.json()["usage"]["completion_tokens"]
        return "refused", (r.status_code, r.headers.get("retry-after"), r.json()["error"])
    # A client that falls behind gets several tokens in one chunk: count from the usage.
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return "refused", (r.status_code, r.headers.get("retry-after"), r.json()["error"])
        chunks = [
            json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")
        ]
        assert any(c["choices"] and c["choices"][0]["text"] for c in chunks), chunks
        return "ok", chunks[-1]["usage"]["completion_tokens"]


async def _grpc_one(
    stub: generation_pb2_grpc.GenerationStub, i: int, max_tokens: int = TOKENS
) -> tuple[str, Any]:
    try:
        tokens = 0
        request = grpc_request(f"{PROMPT} {i}", max_tokens)
        async for response in stub.Generate(request, timeout=120):
            tokens += sum(len(c.token_ids) for c in response.choices)
        return "ok", tokens
    except grpc.aio.AioRpcError as exc:
        return "refused", (exc.code(), exc.details())


async def _burst(stack: RunningStack, count: int) -> list[tuple[str, str, Any]]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with (
        httpx.AsyncClient(base_url=stack.http_url, timeout=120, limits=limits) as client,
        grpc.aio.insecure_channel(stack.gateway) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [_http_one(client, i) if i % 2 else _grpc_one(stub, i) for i in range(count)]
        results = await asyncio.gather(*tasks)
    return [("http" if i % 2 else "grpc", *result) for i, result in enumerate(results)]


async def _num_running(scheduler: str) -> int:
    async with grpc.aio.insecure_channel(scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )
    return sum(r.num_running for r in stats.replicas)


async def _burst_behind_a_full_batch(
    stack: RunningStack, count: int
) -> tuple[list[tuple[str, Any]], list[tuple[str, str, Any]]]:
    """Start MAX_SEQS long requests, wait until all of them run, then send `count` at once.
    With the batch full, every burst request waits in the queue until a long one ends, so
    the queue's QUEUE_LIMIT places are all the burst can count on; how many of a burst into an
    idle scheduler reach the batch before the queue fills depends on the timing of its steps."""
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long_ones = [
            asyncio.ensure_future(_grpc_one(stub, i, LONG_TOKENS)) for i in range(MAX_SEQS)
        ]
        while await _num_running(stack.scheduler) < MAX_SEQS:
            assert not any(task.done() for task in long_ones), "a long request ended early"
            await asyncio.sleep(0.01)
        burst = await _burst(stack, count)
        return list(await asyncio.gather(*long_ones)), burst


def test_backpressure_refuses_the_excess_and_completes_the_rest(stack: RunningStack) -> None:
    long_ones, results = asyncio.run(_burst_behind_a_full_batch(stack, 64))
    assert long_ones == [("ok", LONG_TOKENS)] * MAX_SEQS
    accepted = [r for r in results if r[1] == "ok"]
    refused = [r for r in results if r[1] == "refused"]
    assert len(accepted) + len(refused) == 64
    # The queue takes QUEUE_LIMIT requests while the batch is full; a burst of 64 arrives
    # well within the long requests' LONG_TOKENS steps, so the rest of it is refused.
    assert refused, "nothing was refused"
    assert len(accepted) >= QUEUE_LIMIT, len(accepted)
    # Every admitted request produced all of its tokens.
    assert [r[2] for r in accepted] == [TOKENS] * len(accepted)
    for api, _, detail in refused:
        if api == "http":
            status, retry_after, error = detail
            assert (status, error["type"]) == (429, "rate_limit_error"), detail
            assert retry_after is not None and int(retry_after) >= 1, detail
            assert "--max-waiting-requests" in error["message"], detail
        else:
            code, message = detail
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, detail
            assert "--max-waiting-requests" in message, detail
    stats = wait_idle(stack.scheduler)
    assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))


# -- bad input ---------------------------------------------------------------------------------

BAD_BODIES = [
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"prompt": ["fine", "bad \udfff"]}, "prompt[1]"),
    ({"seed": 2**64}, "seed"),
    ({"top_k": 2**33}, "top_k"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"n": 17, "temperature": 1.0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": ["x" * 257]}, "stop[0]"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
]


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped, as most clients send it: a lone surrogate
    goes as the escape \\ud800 (httpx's own encoder refuses to write it)."""
    return httpx.post(
        url, content=json.dumps(body), timeout=60, headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "param"), BAD_BODIES)
def test_bad_field_is_400_naming_it(
    stack: RunningStack, extra: dict[str, Any], param: str, stream: bool
) -> None:
    body = {**http_body(PROMPT, 4), "stream": stream, **extra}
    r = post_json(stack.http_url + "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_content_with_lone_surrogate_is_400(stack: RunningStack) -> None:
    body = {"messages": [{"role": "user", "content": "hi \ud83d"}], "max_tokens": 4}
    r = post_json(stack.http_url + "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content", r.text


def test_body_over_the_limit_is_refused_naming_the_body(stack: RunningStack) -> None:
    body = http_body("word " * 20_000, 4)  # about 100 kB, over --max-body-bytes 65536
    r = httpx.post(stack.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body" and "--max-body-bytes" in error["message"], error


def test_grpc_limits_name_the_field(stack: RunningStack) -> None:
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        cases = [
            (grpc_request(PROMPT, 4, n=17, temperature=1.0), "sampling_params.n"),
            (grpc_request(PROMPT, 4, top_k=2**32 - 1, logprobs=21), "sampling_params.logprobs"),
        ]
        stop = grpc_request(PROMPT, 4)
        stop.stop.extend(["a", "b", "c", "d"])
        cases.append((stop, "stop"))
        for request, field in cases:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_bad_input_leaves_nothing_behind(stack: RunningStack) -> None:
    for extra, _ in BAD_BODIES:
        post_json(
            stack.http_url + "/v1/completions", {**http_body(PROMPT, 4), "stream": True, **extra}
        )
    gauges = gateway_gauges(httpx.get(stack.http_url + "/metrics", timeout=10).text)
    assert gauges == {
        "llmserve_gateway_requests_in_flight": 0.0,
        "llmserve_gateway_scheduler_requests": 0.0,
    }
    assert is_idle(wait_idle(stack.scheduler))


# -- deadlines ---------------------------------------------------------------------------------


def test_grpc_deadline_aborts_the_request_and_frees_its_blocks(stack: RunningStack) -> None:
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        received = 0
        # The worker is paused, so the request cannot finish before its 0.1 s deadline; it
        # is in the scheduler by then, holding blocks for the step the worker has not run.
        with stack.paused("worker"), pytest.raises(grpc.RpcError) as caught:
            for response in stub.Generate(grpc_request(PROMPT, LONG_TOKENS), timeout=0.1):
                received += sum(len(c.token_ids) for c in response.choices)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received == 0
    stats = wait_idle(stack.scheduler)
    assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))
    # The worker's step for the aborted request changed nothing for the next one.
    assert http_completion_tokens(stack, TOKENS) == TOKENS


def test_scheduler_aborts_a_request_whose_timeout_passes(stack: RunningStack) -> None:
    """The scheduler's own deadline: AddRequest.timeout_ms, on a raw Connect stream, with the
    worker paused so that no step can finish the request first."""
    prompt = [1, 2, 3, 4, 5]
    add = scheduler_pb2.AddRequest(request_id="deadline-1", prompt_token_ids=prompt, timeout_ms=200)
    add.sampling_params.CopyFrom(grpc_request(PROMPT, LONG_TOKENS).sampling_params)

    def messages() -> Iterator[scheduler_pb2.GatewayMessage]:
        yield scheduler_pb2.GatewayMessage(add=add)
        time.sleep(30)  # the stream stays open until the test has its answer

    with stack.paused("worker"), grpc.insecure_channel(stack.scheduler) as channel:
        replies = scheduler_pb2_grpc.SchedulerStub(channel).Connect(messages(), timeout=60)
        tokens = 0
        for reply in (r for message in replies for r in unbatched(message)):
            if reply.WhichOneof("kind") == "error":
                error = reply.error
                break
            tokens += sum(len(c.token_ids) for c in reply.output.choices)
        replies.cancel()
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], error
    assert error.request_id == "deadline-1"
    assert tokens == 0
    stats = wait_idle(stack.scheduler)
    assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))
    assert http_completion_tokens(stack, TOKENS) == TOKENS


def http_completion_tokens(stack: RunningStack, max_tokens: int) -> int:
    """One plain completion through the gateway, `ignore_eos`: its completion_tokens."""
    r = httpx.post(
        stack.http_url + "/v1/completions", json=http_body(PROMPT, max_tokens), timeout=60
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])
