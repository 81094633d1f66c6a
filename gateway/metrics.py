"""The gateway's Prometheus metrics (served at /metrics on the HTTP port).

Latencies here are what a client sees, on the gateway's clock (the scheduler hop and
detokenization included); the scheduler's own histograms, and the timings a client is sent,
measure from its arrival there. Token counts are the scheduler's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from gateway.generation_types import Usage

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

REQUESTS = Counter("llmserve_http_requests", "OpenAI API requests", ["endpoint", "mode"])
FINISHED = Counter(
    "llmserve_gateway_requests_finished", "Requests finished at the gateway", ["finish_reason"]
)
PROMPT_TOKENS = Counter("llmserve_gateway_prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter(
    "llmserve_gateway_generation_tokens", "Tokens generated for finished requests"
)
TTFT_SECONDS = Histogram(
    "llmserve_gateway_time_to_first_token_seconds",
    "Request received to first token",
    buckets=_LATENCY_BUCKETS,
)
TPOT_SECONDS = Histogram(
    "llmserve_gateway_time_per_output_token_seconds",
    "Mean time between output tokens of a request",
    buckets=_TOKEN_BUCKETS,
)
E2E_SECONDS = Histogram(
    "llmserve_gateway_e2e_request_latency_seconds",
    "Request received to last token",
    buckets=_LATENCY_BUCKETS,
)


SHARD_REQUESTS = Gauge(
    "llmserve_gateway_shard_requests",
    "Unfinished requests the gateway has on each scheduler shard (not those waiting for one)",
    ["shard"],
)
GRAMMAR_CHECKS = Histogram(
    "llmserve_gateway_grammar_check_seconds",
    "Admission check of a request's grammar (a compile without the tokenizer)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
GRAMMAR_REFUSED = Counter(
    "llmserve_gateway_grammar_refused",
    "Requests refused at admission for their grammar, by reason (invalid, too_large, slow)",
    ["reason"],
)


def record_finished(
    finish_reasons: list[str], usage: Usage, first_token_ns: int, e2e_ns: int
) -> None:
    FINISHED.labels(",".join(sorted(set(finish_reasons))) or "unknown").inc()
    PROMPT_TOKENS.inc(usage.prompt_tokens)
    GENERATION_TOKENS.inc(usage.completion_tokens)
    completion_tokens = usage.completion_tokens
    E2E_SECONDS.observe(e2e_ns / 1e9)
    if first_token_ns:
        TTFT_SECONDS.observe(first_token_ns / 1e9)
        if completion_tokens > 1:
            TPOT_SECONDS.observe((e2e_ns - first_token_ns) / 1e9 / (completion_tokens - 1))
