"""Soak: 2,000 requests at high concurrency against a live stack (tiny model), HTTP and gRPC,
streaming and not, with random client cancellations and about 10% malformed requests.

Every good request that is not cancelled completes with exactly the greedy text of its prompt
(compared with a reference taken alone before the soak); every bad one gets a 4xx /
INVALID_ARGUMENT; there is no 5xx; the KV cache ends with every block free; the gateway's and
scheduler's RSS stay within RSS_GROWTH_MIB of where they were after warm-up. Bounded: the
load stops after SOAK_BUDGET_S whatever is left. With LLMSERVE_SOAK_OUT set, the figures are
written there as JSON (bench/results/hardening_soak.json; bench/RESULTS.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from llmserve.v1 import common_pb2, generation_pb2_grpc
from tests.support.hardening import (
    blocks,
    gateway_gauges,
    grpc_request,
    http_body,
    is_idle,
    rss_mib,
    wait_idle,
)
from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

REQUESTS = 2000
CONCURRENCY = 64
BAD_FRACTION = 0.10
CANCEL_FRACTION = 0.10
SOAK_BUDGET_S = 200.0
# Growth allowed over the RSS measured after warm-up, for each of gateway and scheduler.
RSS_GROWTH_MIB = 256.0
PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)]
LENGTHS = (4, 8)
BAD_HTTP = [
    {"prompt": "\ud800"},
    {"seed": 2**64},
    {"top_k": 2**33},
    {"n": 0},
    {"temperature": -3},
    {"max_tokens": 10**6},
    {"stop": ["x" * 1000]},
    {"logprobs": 99},
    {"prompt": []},
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(str(tiny_model_dir), tmp_path_factory.mktemp("soak-logs"))
    yield running
    running.stop()


class _Rss:
    """Peak RSS of the gateway and the scheduler, sampled every 0.2 s in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {name: rss_mib(pid) for name, pid in pids.items()}
        self.start = dict(self.peak)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_mib(pid))

    def __enter__(self) -> _Rss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _references(stack: RunningStack) -> dict[tuple[str, int], str]:
    out = {}
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        for prompt in PROMPTS:
            r = client.post("/v1/completions", json=http_body(prompt, max(LENGTHS)))
            r.raise_for_status()
            full = r.json()["choices"][0]["text"]
            for n in LENGTHS:
                r = client.post("/v1/completions", json=http_body(prompt, n))
                out[(prompt, n)] = r.json()["choices"][0]["text"]
            assert out[(prompt, max(LENGTHS))] == full
        # The scheduler loads its tokenizer and grammar backend (transformers with them) in a
        # thread after a replica joins; a constrained request waits for that to end, so the
        # RSS baseline includes it.
        body = {**http_body(PROMPTS[0], 4), "response_format": {"type": "json_object"}}
        client.post("/v1/completions", json=body).raise_for_status()
    return out


def _plan(rng: random.Random) -> list[dict[str, Any]]:
    plan = []
    for i in range(REQUESTS):
        kind = (
            "bad"
            if rng.random() < BAD_FRACTION
            else ("cancel" if rng.random() < CANCEL_FRACTION else "good")
        )
        plan.append(
            {
                "i": i,
                "kind": kind,
                "api": rng.choice(["http", "http", "grpc"]),
                "stream": rng.random() < 0.5,
                "prompt": rng.choice(PROMPTS),
                "tokens": rng.choice(LENGTHS),
                "bad": rng.choice(BAD_HTTP),
            }
        )
    return plan


async def _http(client: httpx.AsyncClient, p: dict[str, Any]) -> tuple[int, str | None]:
    body = http_body(p["prompt"], p["tokens"], stream=p["stream"] or p["kind"] == "cancel")
    if p["kind"] == "bad":
        body.update(p["bad"])
    content = json.dumps(body)  # escapes lone surrogates, as clients' JSON does
    headers = {"content-type": "application/json"}
    if not body["stream"]:
        r = await client.post("/v1/completions", content=content, headers=headers)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None
    async with client.stream("POST", "/v1/completions", content=content, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        text = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, None  # an error after a 200 counts as a server failure
                text.append(chunk["choices"][0]["text"])
                if p["kind"] == "cancel":
                    return 499, None  # the client hangs up mid-stream
        return 200, "".join(text)


async def _grpc(stub: generation_pb2_grpc.GenerationStub, p: dict[str, Any]) -> tuple[int, Any]:
    request = grpc_request(p["prompt"], p["tokens"])
    if p["kind"] == "bad":
        request.sampling_params.CopyFrom(common_pb2.SamplingParams(n=0, max_tokens=4))
    call = stub.Generate(request, timeout=120)
    text = []
    try:
        async for response in call:
            text.extend(c.text for c in response.choices)
            if p["kind"] == "cancel":
                call.cancel()
                return 499, None
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and p["kind"] == "cancel":
            return 499, None
        return {grpc.StatusCode.INVALID_ARGUMENT: 400}.get(exc.code(), 500), exc.code().name
    return 200, "".join(text)


async def _soak(stack: RunningStack, plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    # Idle connections expire on the client before the server's keep-alive timeout (uvicorn's
    # 5 s): else a request may go out on a connection the server is closing at that moment,
    # a race that HTTP/1.1 leaves to the client (a ReadError, not a server failure).
    limits = httpx.Limits(
        max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY, keepalive_expiry=2.0
    )
    deadline = time.monotonic() + SOAK_BUDGET_S
    async with (
        httpx.AsyncClient(base_url=stack.http_url, timeout=120, limits=limits) as client,
        grpc.aio.insecure_channel(stack.gateway) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(p: dict[str, Any]) -> dict[str, Any]:
            async with semaphore:
                if time.monotonic() > deadline:
                    return {**p, "status": None}
                start = time.perf_counter()
                status, text = await (_http(client, p) if p["api"] == "http" else _grpc(stub, p))
                return {
                    **p,
                    "status": status,
                    "text": text,
                    "latency_s": time.perf_counter() - start,
                }

        return await asyncio.gather(*(one(p) for p in plan))


def test_soak(stack: RunningStack) -> None:
    references = _references(stack)
    pids = {name: stack.procs[name].pid for name in ("gateway", "scheduler")}
    load_before = os.getloadavg()
    started = time.monotonic()
    with _Rss(pids) as rss:
        results = asyncio.run(_soak(stack, _plan(random.Random(0))))
    elapsed = time.monotonic() - started
    load_after = os.getloadavg()

    ran = [r for r in results if r["status"] is not None]
    statuses = Counter(r["status"] for r in ran)
    wrong = [
        r
        for r in ran
        if r["kind"] == "good"
        and (r["status"] != 200 or r["text"] != references[(r["prompt"], r["tokens"])])
    ]
    bad_not_4xx = [r for r in ran if r["kind"] == "bad" and not 400 <= r["status"] < 500]
    latencies = sorted(r["latency_s"] for r in ran if r["kind"] == "good")
    stats = wait_idle(stack.scheduler)
    gauges = gateway_gauges(httpx.get(stack.http_url + "/metrics", timeout=10).text)
    figures = {
        "requests": len(ran),
        "planned": REQUESTS,
        "concurrency": CONCURRENCY,
        "good": sum(r["kind"] == "good" for r in ran),
        "cancelled": sum(r["kind"] == "cancel" for r in ran),
        "bad_inputs": sum(r["kind"] == "bad" for r in ran),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(s >= 500 for s in statuses.elements()),
        "wrong_outputs": len(wrong),
        "p50_latency_s": round(latencies[len(latencies) // 2], 3),
        "p99_latency_s": round(latencies[int(len(latencies) * 0.99)], 3),
        "elapsed_s": round(elapsed, 1),
        "rss_start_mib": {k: round(v, 1) for k, v in rss.start.items()},
        "rss_peak_mib": {k: round(v, 1) for k, v in rss.peak.items()},
        "rss_bound_mib": RSS_GROWTH_MIB,
        "blocks_free_total": blocks(stats),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(figures, indent=2))
    out = os.environ.get("LLMSERVE_SOAK_OUT")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
    assert len(ran) == REQUESTS, f"only {len(ran)} of {REQUESTS} ran within {SOAK_BUDGET_S} s"
    assert figures["server_errors"] == 0, statuses
    assert not wrong, wrong[:3]
    assert not bad_not_4xx, bad_not_4xx[:3]
    assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))
    assert set(gauges.values()) == {0.0}, gauges
    for name in pids:
        assert rss.peak[name] - rss.start[name] < RSS_GROWTH_MIB, (name, rss.start, rss.peak)
