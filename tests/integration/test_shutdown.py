"""Graceful shutdown against a live stack: SIGTERM during streams turns health NOT_SERVING,
refuses new requests, lets every stream in flight finish, then the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import generation_pb2_grpc
from tests.support.hardening import blocks, grpc_request, http_body, is_idle, wait_idle
from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

STREAMS = 16
TOKENS = 400  # long enough to be in flight through the checks below (context: 512)
PROMPT = "Once upon a time"


class _Streams:
    """STREAMS streams through the gateway, half HTTP (SSE) and half gRPC, counting tokens."""

    def __init__(self, stack: RunningStack, count: int) -> None:
        self.stack = stack
        self.count = count
        self.started = [asyncio.Event() for _ in range(count)]
        self.tokens = [0] * count
        self.finished = [False] * count

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.count + 4)
        async with (
            httpx.AsyncClient(base_url=self.stack.http_url, timeout=300, limits=limits) as http,
            grpc.aio.insecure_channel(self.stack.gateway) as channel,
        ):
            stub = generation_pb2_grpc.GenerationStub(channel)
            await asyncio.gather(
                *(self._http(http, i) if i % 2 else self._grpc(stub, i) for i in range(self.count))
            )

    async def _http(self, http: httpx.AsyncClient, i: int) -> None:
        body = http_body(f"{PROMPT} {i}", TOKENS, stream=True)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    self.tokens[i] += 1
                    self.started[i].set()
                elif line == "data: [DONE]":
                    self.finished[i] = True

    async def _grpc(self, stub: generation_pb2_grpc.GenerationStub, i: int) -> None:
        async for response in stub.Generate(grpc_request(f"{PROMPT} {i}", TOKENS), timeout=300):
            self.tokens[i] += sum(len(c.token_ids) for c in response.choices)
            self.started[i].set()
            if response.HasField("usage"):
                self.finished[i] = True

    async def wait_started(self) -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.started)), 120)


async def _health(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return reply.status


async def _wait_not_serving(address: str) -> None:
    for _ in range(100):
        if await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{address} never reported NOT_SERVING")


async def _one_grpc(address: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            async for _ in stub.Generate(grpc_request(PROMPT, 4), timeout=60):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _finish(
    streams: _Streams, running: asyncio.Task[None], proc: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """Wait for the streams, then for the signalled process: what each stream got, and its
    exit status."""
    await running
    exit_status = await asyncio.to_thread(proc.wait, 120)
    return {"tokens": streams.tokens, "finished": streams.finished, "exit": exit_status}


async def _one_http(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url + "/v1/completions", json=http_body(PROMPT, 4))


def test_sigterm_on_the_gateway_finishes_every_stream_then_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    stack = start_stack(
        str(tiny_model_dir),
        tmp_path,
        gateway_args=["--max-pending-requests", str(STREAMS), "--shutdown-grace-s", "120"],
    )
    gateway = stack.procs["gateway"]
    try:

        async def scenario() -> dict[str, Any]:
            streams = _Streams(stack, STREAMS)
            running = asyncio.create_task(streams.run())
            await streams.wait_started()
            seen: dict[str, Any] = {}
            # The gateway is full: one more is refused at once, on both APIs.
            seen["full_grpc"] = await _one_grpc(stack.gateway)
            seen["full_http"] = await _one_http(stack.http_url)
            gateway.send_signal(signal.SIGTERM)
            await _wait_not_serving(stack.gateway)
            seen["draining_grpc"] = await _one_grpc(stack.gateway)
            seen["draining_http"] = await _one_http(stack.http_url)
            return seen | await _finish(streams, running, gateway)

        seen = asyncio.run(scenario())
        assert seen["full_grpc"] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert seen["full_http"].status_code == 429, seen["full_http"].text
        assert int(seen["full_http"].headers["retry-after"]) >= 1
        assert seen["draining_grpc"] == grpc.StatusCode.UNAVAILABLE
        assert seen["draining_http"].status_code == 503, seen["draining_http"].text
        assert int(seen["draining_http"].headers["retry-after"]) >= 1
        assert seen["tokens"] == [TOKENS] * STREAMS
        assert seen["finished"] == [True] * STREAMS
        assert seen["exit"] == 0, stack.logs("gateway")[-3000:]
        log = stack.logs("gateway")
        assert "drained" in log and f"finished={STREAMS}" in log.replace(
            '"finished": ', "finished="
        ), log[-3000:]
        stats = wait_idle(stack.scheduler)
        assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))
    finally:
        stack.stop()


def test_sigterm_on_the_scheduler_drains_its_requests_then_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    count = 8
    stack = start_stack(str(tiny_model_dir), tmp_path, scheduler_args=["--shutdown-grace-s", "120"])
    scheduler = stack.procs["scheduler"]
    try:

        async def scenario() -> dict[str, Any]:
            streams = _Streams(stack, count)
            running = asyncio.create_task(streams.run())
            await streams.wait_started()
            scheduler.send_signal(signal.SIGTERM)
            await _wait_not_serving(stack.scheduler)
            seen: dict[str, Any] = {"draining_grpc": await _one_grpc(stack.gateway)}
            return seen | await _finish(streams, running, scheduler)

        seen = asyncio.run(scenario())
        assert seen["draining_grpc"] == grpc.StatusCode.UNAVAILABLE
        assert seen["tokens"] == [TOKENS] * count
        assert seen["finished"] == [True] * count
        assert seen["exit"] == 0, stack.logs("scheduler")[-3000:]
        log = stack.logs("scheduler").replace('"finished": ', "finished=")
        assert "drained" in log and f"finished={count}" in log, log[-3000:]
    finally:
        stack.stop()
