"""bench/step_metrics.py: the services' metrics read over HTTP from a real Prometheus
endpoint, their ports found on real processes' command lines, and the per-step figures of
an interval worked out here by hand from what was observed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from step_metrics import metrics_ports, scrape, step_breakdown  # noqa: E402

from llmserve.ports import free_port  # noqa: E402


@pytest.fixture
def worker_endpoint() -> Iterator[tuple[int, dict[str, Any]]]:
    """A registry with the worker's and scheduler's metric names, served on loopback."""
    registry = CollectorRegistry()
    metrics: dict[str, Any] = {
        "steps": Counter("llmserve_worker_steps", "", registry=registry),
        "tokens": Counter("llmserve_worker_tokens", "", registry=registry),
        "forward": Histogram("llmserve_worker_forward_seconds", "", registry=registry),
        "sample": Histogram("llmserve_worker_sample_seconds", "", registry=registry),
        "prepare": Histogram("llmserve_worker_prepare_seconds", "", registry=registry),
        "gap": Histogram(
            "llmserve_worker_forward_gap_seconds", "", ["next_step"], registry=registry
        ),
        "wait": Histogram("llmserve_worker_step_wait_seconds", "", registry=registry),
        "graph": Counter("llmserve_worker_graph_steps", "", registry=registry),
        "eager": Counter("llmserve_worker_eager_steps", "", ["reason"], registry=registry),
        "iteration": Histogram("llmserve_iteration_seconds", "", ["replica"], registry=registry),
    }
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield port, metrics
    server.shutdown()
    thread.join(timeout=10)


def test_an_interval_s_steps_come_out_per_step(worker_endpoint: tuple[int, dict[str, Any]]) -> None:
    port, m = worker_endpoint
    m["steps"].inc(3)  # before the interval: left out of its figures
    m["eager"].labels("prefill").inc(3)
    before = {"worker": scrape(port), "scheduler": scrape(port)}
    # The interval: 4 steps of 10 tokens, 1 prefill step and 3 graph replays, forward
    # passes of 2, 4, 6 and 8 ms, sampling 1 ms each, gaps of 3 ms (awaited) and 1 ms (queued
    # twice), the model thread waiting 2 and 6 ms before two of the steps, scheduler
    # iterations of 10 and 20 ms on two replicas.
    m["steps"].inc(4)
    m["tokens"].inc(40)
    for f in (0.002, 0.004, 0.006, 0.008):
        m["forward"].observe(f)
        m["sample"].observe(0.001)
        m["prepare"].observe(f / 2)
    m["gap"].labels("awaited").observe(0.003)
    m["gap"].labels("queued").observe(0.001)
    m["gap"].labels("queued").observe(0.001)
    m["wait"].observe(0.002)
    m["wait"].observe(0.006)
    m["graph"].inc(3)
    m["eager"].labels("prefill").inc()
    m["iteration"].labels("r0").observe(0.010)
    m["iteration"].labels("r1").observe(0.020)
    after = {"worker": scrape(port), "scheduler": scrape(port)}
    cpu_before = {"worker": 10.0, "scheduler": 1.0, "gateway": 2.0}
    cpu_after = {"worker": 10.2, "scheduler": 1.04, "gateway": 2.0, "llmserve": 0.01}

    b = step_breakdown(before, after, cpu_before, cpu_after, wall_s=2.0)

    assert b["steps"] == 4 and b["steps_per_s"] == 2.0 and b["tokens_per_step"] == 10
    assert b["worker_forward_ms"] == pytest.approx(5.0)
    assert b["worker_sample_ms"] == pytest.approx(1.0)
    assert b["worker_prepare_ms"] == pytest.approx(2.5)  # half of each forward pass
    assert b["scheduler_iteration_ms"] == pytest.approx(15.0)  # both replicas' iterations
    assert b["gap_awaited_ms"] == pytest.approx(3.0) and b["gaps_awaited"] == 1
    assert b["gap_queued_ms"] == pytest.approx(1.0) and b["gaps_queued"] == 2
    assert b["worker_waited_ms"] == pytest.approx(2.0)  # 8 ms over 4 steps
    assert b["graph_steps"] == 3 and b["eager_steps"] == {"prefill": 1}
    assert b["cpu_ms_per_step"] == pytest.approx(
        {"worker": 50.0, "scheduler": 10.0, "gateway": 0.0, "llmserve": 2.5}
    )


def test_an_idle_interval_has_no_means(worker_endpoint: tuple[int, dict[str, Any]]) -> None:
    port, m = worker_endpoint
    m["steps"].inc(2)
    snap = {"worker": scrape(port)}
    b = step_breakdown(snap, snap, {}, {}, wall_s=1.0)
    assert b["steps"] == 0 and b["worker_forward_ms"] is None and b["eager_steps"] == {}
    assert b["worker_waited_ms"] is None


def test_metrics_ports_are_read_off_the_services_command_lines() -> None:
    # Children named as `llmserve up`'s services are, one of them without a metrics port.
    sleeper = "import sys; sys.stdin.read()"
    commands = [
        ["-m", "llmserve.cli", "worker", "--port", "1", "--metrics-port", "4321"],
        ["-m", "llmserve.cli", "scheduler", "--metrics-port", "4322", "--workers", "x"],
        ["-m", "llmserve.cli", "gateway", "--http-port", "5"],
    ]
    spawn = (
        "import subprocess, sys\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {sleeper!r}, *c], "
        "stdin=subprocess.PIPE) for c in "
        f"{commands!r}]\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
        "[k.communicate(b'') for k in kids]\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"up\n"
        ports = metrics_ports(parent.pid)
    finally:
        parent.communicate(b"", timeout=60)
    assert ports == {"worker": 4321, "scheduler": 4322}
