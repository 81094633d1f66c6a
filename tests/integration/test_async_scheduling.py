"""Asynchronous scheduling over real processes: a stack whose scheduler runs with
--async-scheduling and one with --no-async-scheduling (each a worker on the embedded SmolLM2,
a scheduler and a gateway) stream the same tokens for greedy and seeded requests, one with
stop strings and one the client aborts; both end with every block free. The worker's
forward-gap histogram shows that only the asynchronous scheduler's steps were waiting for the
worker when its previous forward pass ended."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import grpc
import httpx
import pytest

from llmserve.client import build_request
from llmserve.grpc_utils import channel_options
from llmserve.v1 import common_pb2, generation_pb2_grpc
from tests.support.fleet import FleetStack, start_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

MODEL = "smollm2"
# A long lease: the first request with stop strings loads the tokenizer on the scheduler's
# event loop, which on a loaded machine can stall it longer than the fleet harness's 3 s.
# One token a step: the gaps counted below are per step (multi-step decoding would make
# a few steps of several tokens out of the single streams).
SCHEDULER_ARGS = ["--worker-lease-s", "120", "--decode-steps", "1"]
WORKER_ARGS = [
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "0.1",
    "--swap-space",
    "0.02",
    "--num-threads",
    "1",
]
ABORTED = "abort-me"
ABORT_AFTER_CHUNKS = 5
STOPPED = "stop-strings"
REQUESTS: list[tuple[str, str, dict]] = [  # type: ignore[type-arg]
    ("greedy", "The capital of France is", {"temperature": 0.0, "max_tokens": 24}),
    ("seeded", "Once upon a time", {"temperature": 0.9, "seed": 11, "max_tokens": 24}),
    (
        "seeded-n2",
        "My favourite food is",
        {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 16},
    ),
    (
        STOPPED,
        "Here is a list of fruits: apples,",
        {"temperature": 0.0, "max_tokens": 48, "stop": [",", "."]},
    ),
    (
        ABORTED,
        "The history of computing",
        {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
    ),
]


def start(tmp_path_factory: pytest.TempPathFactory, flag: str) -> FleetStack:
    return start_fleet(
        MODEL,
        tmp_path_factory.mktemp(flag.strip("-")),
        1,
        scheduler_args=[flag, *SCHEDULER_ARGS],
        worker_args=WORKER_ARGS,
    )


@pytest.fixture(scope="module")
def async_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start(tmp_path_factory, "--async-scheduling")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def sync_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start(tmp_path_factory, "--no-async-scheduling")
    yield stack
    stack.stop()


async def run(gateway: str) -> dict[str, tuple[dict[int, list[int]], dict[int, int]]]:
    """Every request at once; per request, per choice: tokens as streamed, finish reason. The
    client cancels ABORTED after ABORT_AFTER_CHUNKS responses."""
    received: dict[str, tuple[dict[int, list[int]], dict[int, int]]] = {}
    async with grpc.aio.insecure_channel(gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(request_id: str, prompt: str, spec: dict) -> None:  # type: ignore[type-arg]
            tokens: dict[int, list[int]] = {}
            reasons: dict[int, int] = {}
            received[request_id] = (tokens, reasons)
            call = stub.Generate(build_request(prompt, request_id=request_id, **spec), timeout=300)
            chunks = 0
            async for response in call:
                for choice in response.choices:
                    assert choice.index not in reasons, "a token streamed past a stop"
                    tokens.setdefault(choice.index, []).extend(choice.token_ids)
                    if choice.finish_reason:
                        reasons[choice.index] = choice.finish_reason
                chunks += 1
                if request_id == ABORTED and chunks == ABORT_AFTER_CHUNKS:
                    call.cancel()
                    break

        await asyncio.gather(*(one(rid, prompt, spec) for rid, prompt, spec in REQUESTS))
    return received


def forward_gaps(stack: FleetStack) -> dict[str, tuple[float, float]]:
    """The worker's llmserve_worker_forward_gap_seconds: {next_step: (count, sum)}."""
    args = stack.workers[0].args
    port = args[args.index("--metrics-port") + 1]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    gaps: dict[str, list[float]] = {}
    pattern = r'llmserve_worker_forward_gap_seconds_(count|sum)\{next_step="(\w+)"\} (\S+)'
    for field, kind, value in re.findall(pattern, text):
        gaps.setdefault(kind, [0.0, 0.0])[0 if field == "count" else 1] = float(value)
    return {k: (v[0], v[1]) for k, v in gaps.items()}


def test_async_and_sync_scheduling_stream_the_same_tokens(
    async_stack: FleetStack, sync_stack: FleetStack
) -> None:
    pipelined = asyncio.run(run(async_stack.gateway.address))  # type: ignore[union-attr]
    synchronous = asyncio.run(run(sync_stack.gateway.address))  # type: ignore[union-attr]
    async_stack.assert_no_leak()
    sync_stack.assert_no_leak()
    for request_id, _, _ in REQUESTS:
        got, want = pipelined[request_id], synchronous[request_id]
        if request_id == ABORTED:
            # What the client read before it cancelled: the same tokens (a chunk may carry
            # more than one when the client lags, so the lengths may differ).
            a, b = got[0][0], want[0][0]
            assert min(len(a), len(b)) >= ABORT_AFTER_CHUNKS
            assert a[: len(b)] == b[: len(a)]
            assert not got[1] and not want[1]  # cancelled, never finished
            continue
        assert got == want, request_id
    stop_reasons = synchronous[STOPPED][1]
    assert stop_reasons == {0: common_pb2.FINISH_REASON_STOP}
    assert len(synchronous[STOPPED][0][0]) < 48

    async_gaps, sync_gaps = forward_gaps(async_stack), forward_gaps(sync_stack)
    # Synchronously, the worker always waits for the next step; asynchronously, most decode
    # steps were already there when the previous forward pass ended.
    assert sync_gaps.get("queued", (0.0, 0.0))[0] == 0
    assert async_gaps["queued"][0] >= 20
    count, total = async_gaps["queued"]
    print(f"forward gap, queued (async): {count:.0f} gaps, mean {total / count * 1e3:.3f} ms")
    count, total = sync_gaps["awaited"]
    print(f"forward gap, awaited (sync): {count:.0f} gaps, mean {total / count * 1e3:.3f} ms")
