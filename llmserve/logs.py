"""structlog configuration shared by every service.

JSON lines when stderr is not a terminal (containers, `llmserve up` children), a readable
console otherwise. The current OpenTelemetry span's trace and span ids are added to every
line (unless a trace_id is bound or passed explicitly, as the scheduler does for requests it
follows across many steps), so one request's lines share its trace id across services.
Request handlers bind `request_id` (and `trace_id`) with `structlog.contextvars`, which
`merge_contextvars` adds to every line logged while the request is handled.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def _add_trace_context(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - opentelemetry is a dependency
        return event
    if event.get("trace_id") is not None:
        return event  # bound or passed explicitly (a request followed across steps)
    event.pop("trace_id", None)
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(service: str, level: str = "INFO", json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process."""
    if json is None:
        json = not sys.stderr.isatty()
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"log level: unknown level {level!r}")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_context,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that log through the stdlib (grpc, uvicorn) go through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric_level)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
