"""The gateway's Prometheus metrics (served at /metrics on the HTTP port)."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter("llmserve_http_requests", "OpenAI API requests", ["endpoint", "mode"])
