"""Helpers of the hardening tests: requests that run long, the scheduler's idle state, RSS."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from llmserve.v1 import common_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc


def grpc_request(prompt: str, max_tokens: int, **sampling: Any) -> generation_pb2.GenerateRequest:
    """A request for exactly `max_tokens` tokens (EOS ignored), greedy unless `sampling`
    says otherwise."""
    params = common_pb2.SamplingParams(
        **{"temperature": 0.0, **sampling}, max_tokens=max_tokens, ignore_eos=True
    )
    return generation_pb2.GenerateRequest(text=prompt, sampling_params=params)


def http_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def scheduler_stats(scheduler: str) -> scheduler_pb2.GetStatsResponse:
    with grpc.insecure_channel(scheduler) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )


def wait_idle(scheduler: str, timeout_s: float = 30.0) -> scheduler_pb2.GetStatsResponse:
    """The scheduler's stats once no request is left and every block is free (or the last
    stats seen when that does not happen within `timeout_s`: the caller's asserts say what)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = scheduler_stats(scheduler)
        if is_idle(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def is_idle(stats: scheduler_pb2.GetStatsResponse) -> bool:
    return stats.num_unfinished_requests == 0 and all(
        r.gpu_blocks_free == r.gpu_blocks_total and r.cpu_blocks_free == r.cpu_blocks_total
        for r in stats.replicas
    )


def blocks(stats: scheduler_pb2.GetStatsResponse) -> list[tuple[int, int]]:
    return [(r.gpu_blocks_free, r.gpu_blocks_total) for r in stats.replicas]


def rss_mib(pid: int) -> float:
    """Resident set size of a process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gateway_gauges(metrics_text: str) -> dict[str, float]:
    """The gateway's admission gauges from its /metrics text: requests in flight and
    requests with state at the scheduler client (both 0 when nothing runs)."""
    names = ("llmserve_gateway_requests_in_flight", "llmserve_gateway_scheduler_requests")
    found = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[name] = float(value)
    assert set(found) == set(names), found
    return found
