"""Traces, metrics and logs of the real three-process stack.

Spans go service -> rotel (a real OTLP collector process, from the `rotel` PyPI package) ->
an OTLP gRPC receiver in this test process. rotel has no exporter that writes to a file we
could parse, so it forwards over OTLP to the receiver, which keeps what it gets.

One stack runs for the whole module (starting one costs most of the time): the fixture sends
known traffic, scrapes /metrics around each phase, stops the stack (which flushes every
exporter) and collects the spans; the tests then assert on what it saw.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from llmserve.ports import free_ports
from tests.support.stack import start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

BLOCK_SIZE = 16
GPU_BLOCKS = 8
SHARED_PREFIX = [1000 + i for i in range(64)]  # four full blocks
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
PREEMPT_REQUESTS = 4
PREEMPT_PROMPT = 20  # two blocks each: all four fit the 8-block cache at first ...
PREEMPT_TOKENS = 40  # ... but not the four blocks each needs by the end


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, object]]:
        """(service.name, span) for every span received so far."""
        out = []
        with self.lock:
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {
                        a.key: a.value.string_value for a in resource_spans.resource.attributes
                    }
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            out.append((attrs.get("service.name", ""), span))
        return out


@dataclass
class Observed:
    spans: list[tuple[str, object]]
    metrics: dict[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]
    logs: dict[str, list[dict[str, object]]]
    completions: list[dict[str, object]] = field(default_factory=list)


def _post(url: str, body: dict[str, object], headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[key] = sample.value
    return samples


def _completion(
    url: str, prompt: list[int], max_tokens: int, headers: dict[str, str] | None = None
) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return _post(f"{url}/v1/completions", body, headers)


def _rotel_agent() -> str:
    spec = importlib.util.find_spec("rotel")
    assert spec is not None and spec.submodule_search_locations, "the rotel package is missing"
    return str(Path(spec.submodule_search_locations[0]) / "rotel-agent")


@pytest.fixture(scope="module")
def observed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observability")
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    collector_port, collector_http_port = free_ports(2)
    collector_log = (tmp / "rotel.log").open("wb")
    collector = subprocess.Popen(
        [
            _rotel_agent(), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{collector_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{collector_http_port}",
            "--exporter", "otlp",
            "--otlp-exporter-endpoint", f"http://127.0.0.1:{receiver_port}",
            "--batch-timeout", "100ms",
            "--pid-file", str(tmp / "rotel.pid"),
        ],
        stdout=collector_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    stack = start_stack(
        str(tiny_model_dir),
        tmp,
        # The 8-block cache holds one sequence of 128 tokens, no more (else it is refused).
        worker_args=["--block-size", str(BLOCK_SIZE), "--max-model-len", str(8 * BLOCK_SIZE)],
        scheduler_args=["--num-gpu-blocks-override", str(GPU_BLOCKS)],
        env=env,
        envs={"worker": {"LLMSERVE_LOG_LEVEL": "DEBUG"}},
    )
    try:
        ports = {**stack.metrics_ports, "gateway": stack.http_port}
        before = {name: _scrape(port) for name, port in ports.items()}
        url = stack.http_url
        completions = [_completion(url, [*SHARED_PREFIX, 1, 2, 3, 4, 5, 6], 2)]
        # The traced request: it shares the first four blocks with the one before.
        completions.append(
            _completion(url, [*SHARED_PREFIX, 7, 8, 9], 2, headers={"traceparent": TRACEPARENT})
        )
        mid = {name: _scrape(port) for name, port in ports.items()}
        with futures.ThreadPoolExecutor(PREEMPT_REQUESTS) as pool:
            burst = [
                pool.submit(
                    _completion,
                    url,
                    [2000 + 100 * i + j for j in range(PREEMPT_PROMPT)],
                    PREEMPT_TOKENS,
                )
                for i in range(PREEMPT_REQUESTS)
            ]
            completions += [f.result(timeout=180) for f in burst]
        after = {name: _scrape(port) for name, port in ports.items()}
    finally:
        stack.stop()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            services = {s for s, span in receiver.spans() if span.trace_id.hex() == TRACE_ID}
            if len(services) == 3:
                break
            time.sleep(0.2)
        time.sleep(0.5)  # the last batches of the other traces
    finally:
        collector.terminate()
        collector.wait(timeout=10)
        server.stop(grace=None)
    logs = {
        name: [json.loads(line) for line in stack.logs(name).splitlines() if line.startswith("{")]
        for name in ("gateway", "scheduler", "worker")
    }
    yield Observed(
        receiver.spans(),
        {"before": before, "mid": mid, "after": after},  # type: ignore[dict-item]
        logs,
        completions,
    )


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


# -- traces ------------------------------------------------------------------------------------


def _trace(observed: Observed) -> list[tuple[str, object]]:
    return [(s, span) for s, span in observed.spans if span.trace_id.hex() == TRACE_ID]


def _events(span: object) -> dict[str, dict[str, object]]:
    out = {}
    for event in span.events:  # type: ignore[attr-defined]
        out[event.name] = {a.key: _any(a.value) for a in event.attributes}
    return out


def _any(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return [_any(v) for v in value.array_value.values]  # type: ignore[attr-defined]
    return getattr(value, kind)


def _attrs(span: object) -> dict[str, object]:
    return {a.key: _any(a.value) for a in span.attributes}  # type: ignore[attr-defined]


def test_one_trace_spans_all_three_services(observed: Observed) -> None:
    spans = _trace(observed)
    services = {s for s, _ in spans}
    assert services == {"llmserve-gateway", "llmserve-scheduler", "llmserve-worker"}
    by_name: dict[str, list[object]] = {}
    for _, span in spans:
        by_name.setdefault(span.name, []).append(span)
    # FastAPI's own telemetry adds its HTTP server span (and a dependencies span).
    assert set(by_name) >= {
        "POST /v1/completions",
        "execute",
        "scheduler.request",
        "scheduler.step",
        "text_completion " + _model(observed),
    }


def _model(observed: Observed) -> str:
    return str(observed.completions[0]["model"])


def test_parent_child_relations_across_hops(observed: Observed) -> None:
    spans = _trace(observed)
    (http,) = [span for s, span in spans if span.name == "POST /v1/completions"]
    assert http.parent_span_id.hex() == "00f067aa0ba902b7"  # the client's traceparent
    (gw,) = [span for _, span in spans if span.name.startswith("text_completion ")]
    # The request span nests under FastAPI's HTTP span (through its handler span).
    by_id = {span.span_id: span for _, span in spans}
    chain, parent_id = [], gw.parent_span_id
    while parent_id in by_id:
        chain.append(by_id[parent_id].name)
        parent_id = by_id[parent_id].parent_span_id
    assert chain == ["fastapi.endpoint", "POST /v1/completions"]
    (request,) = [span for _, span in spans if span.name == "scheduler.request"]
    assert request.parent_span_id == gw.span_id
    steps = {span.span_id: span for _, span in spans if span.name == "scheduler.step"}
    # Prefill of the 3 uncached tokens, then one decode: max_tokens=2.
    assert len(steps) == 2
    for step in steps.values():
        assert step.parent_span_id == request.span_id
        assert [link.span_id for link in step.links] == [request.span_id]
    executes = [span for _, span in spans if span.name == "execute"]
    assert len(executes) == 2
    assert {e.parent_span_id for e in executes} == set(steps)
    prefill = next(s for s in steps.values() if _attrs(s)["llmserve.step.prefill_tokens"])
    assert _attrs(prefill)["llmserve.step.prefill_tokens"] == 3
    assert _attrs(prefill)["llmserve.step.sequences"] == 1
    assert set(_attrs(executes[0])) >= {"llmserve.worker.forward_s", "llmserve.worker.sample_s"}


def test_gateway_span_has_gen_ai_attributes(observed: Observed) -> None:
    (gw,) = [span for _, span in _trace(observed) if span.name.startswith("text_completion ")]
    attrs = _attrs(gw)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == _model(observed)
    assert attrs["gen_ai.request.max_tokens"] == 2
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.top_p"] == 1.0
    assert attrs["gen_ai.request.choice.count"] == 1
    assert attrs["gen_ai.usage.input_tokens"] == 67
    assert attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["llmserve.time_to_first_token_s"] > 0
    assert "first_token" in _events(gw)


def test_request_span_lifecycle_events(observed: Observed) -> None:
    (request,) = [span for _, span in _trace(observed) if span.name == "scheduler.request"]
    events = _events(request)
    assert [e.name for e in request.events] == [
        "queued",
        "routed",
        "scheduled",
        "prefix_cache_hit",
        "first_token",
        "finished",
    ]
    assert events["prefix_cache_hit"] == {"blocks": 4}
    # The one worker, picked by the default policy, which already held those 4 blocks.
    assert events["routed"]["policy"] == "cache_aware"
    assert events["routed"]["cached_tokens"] == 4 * BLOCK_SIZE
    assert events["routed"]["worker"].startswith("127.0.0.1:")
    assert events["finished"] == {"reason": "length"}


def test_preempted_requests_have_preemption_events(observed: Observed) -> None:
    requests = [span for _, span in observed.spans if span.name == "scheduler.request"]
    assert len(requests) == 2 + PREEMPT_REQUESTS
    preempted = [r for r in requests if "preempted" in _events(r)]
    assert preempted
    for span in preempted:
        names = [e.name for e in span.events]
        assert _events(span)["preempted"] == {"mode": "recompute"}
        # Recompute puts the request back in the queue: it is scheduled again.
        assert names.count("scheduled") == names.count("preempted") + 1
        assert names[-1] == "finished"
    # Every step that ran a preempted request links to it.
    step_links = {
        link.span_id for _, s in observed.spans if s.name == "scheduler.step" for link in s.links
    }
    assert {r.span_id for r in requests} <= step_links


# -- metrics -----------------------------------------------------------------------------------


def _delta(observed: Observed, service: str, name: str, frm: str, to: str, **labels: str) -> float:
    m = observed.metrics
    return _value(m[to][service], name, **labels) - _value(m[frm][service], name, **labels)


def test_prefix_cache_counters(observed: Observed) -> None:
    # Each prompt has 4 full blocks (64 shared tokens + a partial tail); the second hits all 4.
    assert (
        _delta(
            observed,
            "scheduler",
            "llmserve_prefix_cache_queries_total",
            "before",
            "mid",
            replica="0",
        )
        == 8
    )
    assert (
        _delta(
            observed, "scheduler", "llmserve_prefix_cache_hits_total", "before", "mid", replica="0"
        )
        == 4
    )


def test_preemption_counters(observed: Observed) -> None:
    recompute, swap = (
        _delta(
            observed,
            "scheduler",
            "llmserve_preemptions_total",
            "mid",
            "after",
            replica="0",
            mode=mode,
        )
        for mode in ("recompute", "swap")
    )
    assert recompute >= 1  # how many depends on when the concurrent requests arrive
    assert swap == 0  # single-sequence requests are always recomputed
    for c in observed.completions[2:]:
        assert c["usage"]["completion_tokens"] == PREEMPT_TOKENS  # type: ignore[index]


def test_token_and_latency_metrics_on_every_service(observed: Observed) -> None:
    n = 2 + PREEMPT_REQUESTS
    gen_tokens = 2 + 2 + PREEMPT_REQUESTS * PREEMPT_TOKENS
    gw = "gateway"
    assert (
        _delta(observed, gw, "llmserve_gateway_generation_tokens_total", "before", "after")
        == gen_tokens
    )
    assert _delta(observed, gw, "llmserve_gateway_prompt_tokens_total", "before", "after") == (
        70 + 67 + PREEMPT_REQUESTS * PREEMPT_PROMPT
    )
    assert (
        _delta(
            observed, gw, "llmserve_gateway_time_to_first_token_seconds_count", "before", "after"
        )
        == n
    )
    assert (
        _delta(
            observed, gw, "llmserve_gateway_e2e_request_latency_seconds_count", "before", "after"
        )
        == n
    )
    sched = "scheduler"
    assert (
        _delta(observed, sched, "llmserve_generation_tokens_total", "before", "after", replica="0")
        == gen_tokens
    )
    assert (
        _delta(observed, sched, "llmserve_time_to_first_token_seconds_count", "before", "after")
        == n
    )
    assert (
        _delta(observed, sched, "llmserve_e2e_request_latency_seconds_count", "before", "after")
        == n
    )
    assert (
        _delta(observed, sched, "llmserve_request_queue_time_seconds_count", "before", "after") == n
    )
    assert (
        _delta(observed, sched, "llmserve_time_per_output_token_seconds_count", "before", "after")
        == n
    )
    assert (
        _delta(
            observed,
            sched,
            "llmserve_requests_finished_total",
            "before",
            "after",
            finish_reason="length",
        )
        == n
    )
    after = observed.metrics["after"][sched]
    assert _value(after, "llmserve_requests_running", replica="0") == 0
    assert _value(after, "llmserve_requests_waiting", replica="0") == 0
    assert _value(after, "llmserve_requests_swapped", replica="0") == 0
    usage = after["llmserve_kv_cache_usage_ratio"]
    # Each device's, and the one KV group's share of the device blocks (SmolLM2: one group).
    assert set(usage) == {
        (("device", "gpu"), ("group", "all"), ("replica", "0")),
        (("device", "cpu"), ("group", "all"), ("replica", "0")),
        (("device", "gpu"), ("group", "0"), ("replica", "0")),
    }
    steps = _delta(observed, "worker", "llmserve_worker_steps_total", "before", "after")
    assert steps > 0
    assert (
        _delta(observed, "worker", "llmserve_worker_forward_seconds_count", "before", "after")
        == steps
    )
    assert (
        _delta(observed, sched, "llmserve_iteration_seconds_count", "before", "after", replica="0")
        == steps
    )


# -- logs --------------------------------------------------------------------------------------


def test_log_lines_of_a_request_share_its_trace_id(observed: Observed) -> None:
    traced = {
        name: [line for line in lines if line.get("trace_id") == TRACE_ID]
        for name, lines in observed.logs.items()
    }
    gateway_events = [line["event"] for line in traced["gateway"]]
    assert gateway_events == ["request received", "request finished"]
    request_id = traced["gateway"][0]["request_id"]
    assert all(line["request_id"] == request_id for line in traced["gateway"])
    assert [(line["event"], line["request_id"]) for line in traced["scheduler"]] == [
        ("request queued", request_id),
        ("request finished", request_id),
    ]
    assert [line["event"] for line in traced["worker"]] == ["sequences added"]
    assert traced["worker"][0]["request_ids"] == [f"0/{request_id}"]
    # Every request the scheduler logged carries a trace id (tracing is on everywhere).
    queued = [line for line in observed.logs["scheduler"] if line["event"] == "request queued"]
    assert len(queued) == 2 + PREEMPT_REQUESTS
    assert all(len(line["trace_id"]) == 32 for line in queued)
