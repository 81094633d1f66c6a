"""gRPC plumbing shared by the services: server construction, health, reflection, errors."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmserve import security
from llmserve.errors import grpc_status
from llmserve.logs import get_logger

log = get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a servicer into a status code and a message a person can act on."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        def wrap_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async with _mapped_errors(context, method):
                    return await fn(request, context)

            return wrapped

        def wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not inspect.isasyncgenfunction(fn):
                # A streaming handler may also be a coroutine that calls context.write
                # (grpc_health's Watch does).
                return wrap_unary(fn)

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async with _mapped_errors(context, method):
                    async for item in fn(request, context):
                        yield item

            return wrapped

        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, wrap_unary),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, wrap_stream),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, wrap_unary),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, wrap_stream),
        )
        for kind, make_handler, wrap in kinds:
            fn = getattr(handler, kind)
            if fn:
                return make_handler(
                    wrap(fn), handler.request_deserializer, handler.response_serializer
                )
        return handler


@contextlib.asynccontextmanager
async def _mapped_errors(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    """Aborts the call with the status `errors.grpc_status` gives an escaping exception."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        await _abort(context, method, exc)


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, message = grpc_status(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("rpc failed", method=method)
    else:
        log.info("rpc refused", method=method, code=code.name, reason=message)
    await context.abort(code, message)


# Our clients ping every KEEPALIVE_TIME_MS on their long-lived streams, idle or not, so that a
# dead peer is noticed; servers must accept pings that often. gRPC's server default accepts one
# ping per 5 minutes without data and answers the third early one with GOAWAY "too_many_pings",
# which killed the scheduler's idle Execute and Connect streams about 150 s after the last
# request.
KEEPALIVE_TIME_MS = 30_000


# gRPC's reconnect backoff grows each time a connection is refused (to 120 s): a channel
# opened while a service still starts, or restarts, would find it listening only at its next
# attempt, long after. With these options it reconnects within about a second.
PROMPT_RECONNECT: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for our client channels."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for our servers: the client's keepalive pings are welcome (a third of the
    interval leaves room for timer jitter), and the server pings its clients alike."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 3),
    ]


def create_server(
    service_names: Iterable[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with the error interceptor, health service and reflection enabled.

    The caller adds its servicers, binds a port, starts the server, then marks it serving
    with `health_servicer.set(name, SERVING)` once it can take traffic.
    """
    server = grpc.aio.server(
        interceptors=[*interceptors, ErrorMappingInterceptor()],
        options=server_options(max_message_bytes),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def set_serving(
    health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool = True
) -> None:
    """Report SERVING (or NOT_SERVING) for the server as a whole and for each service."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def wait_for_health(address: str, timeout_s: float = 60.0, service: str = "") -> None:
    """Poll grpc.health.v1 at `address` until SERVING (with this process's credentials,
    llmserve.security). Raises TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with security.aio_channel(address, PROMPT_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f} s")
            await asyncio.sleep(0.25)
