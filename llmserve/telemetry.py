"""OpenTelemetry set-up for one service, from the standard `OTEL_*` environment.

Tracing is on when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and not disabled (`OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none`). `OTEL_EXPORTER_OTLP_PROTOCOL` picks `grpc` (default) or
`http/protobuf`; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_TRACES_SAMPLER(_ARG)`
are read by the SDK itself. With tracing off the API's no-op tracer is used: spans cost nothing.

Trace context crosses hops as a W3C `traceparent` string: in gRPC metadata for unary calls,
and inside the message for requests multiplexed over a long-lived stream.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmserve.logs import get_logger

log = get_logger(__name__)

_propagator = TraceContextTextMapPropagator()
_provider: object | None = None


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(default_service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Install a batching OTLP tracer provider if the environment asks for one."""
    global _provider
    env = os.environ if env is None else env
    if not tracing_requested(env):
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported {protocol!r} (grpc or http/protobuf)"
        )
    attributes = {}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = default_service_name
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing enabled", protocol=protocol)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call on service shutdown)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]
        _provider = None


def current_traceparent(span: trace.Span | None = None) -> str:
    """`span`'s context (by default the current span's) as a W3C traceparent ("" when there
    is none)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, None if span is None else trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    """A context whose parent is the given traceparent (the empty context when blank)."""
    if not traceparent:
        return otel_context.Context()
    return _propagator.extract({"traceparent": traceparent})


def context_from_metadata(metadata: object) -> otel_context.Context:
    """The parent for a request's span, from gRPC metadata or HTTP headers ((key, value) pairs).

    When a local server span is already active (FastAPI's built-in telemetry opens one per
    HTTP request, itself a child of the caller's traceparent), that span is the parent, so
    the request span nests under it instead of becoming its sibling.
    """
    current = trace.get_current_span().get_span_context()
    if current.is_valid and not current.is_remote:
        return otel_context.get_current()
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}  # type: ignore[attr-defined]
    return _propagator.extract(carrier)
