"""The worker's Prometheus metrics (served at /metrics on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

STEPS = Counter("llmserve_worker_steps", "Steps executed")
TOKENS = Counter("llmserve_worker_tokens", "Tokens computed (prefill and decode)")
FORWARD_SECONDS = Histogram(
    "llmserve_worker_forward_seconds",
    "Forward pass time per step (incl. swap and copy)",
    buckets=_TIME_BUCKETS,
)
SAMPLE_SECONDS = Histogram(
    "llmserve_worker_sample_seconds", "Sampler time per step", buckets=_TIME_BUCKETS
)
KV_BLOCKS = Gauge("llmserve_worker_kv_blocks", "KV cache blocks allocated", ["device"])


def observe_step(num_tokens: int, forward_ns: int, sample_ns: int) -> None:
    STEPS.inc()
    TOKENS.inc(num_tokens)
    FORWARD_SECONDS.observe(forward_ns / 1e9)
    SAMPLE_SECONDS.observe(sample_ns / 1e9)
