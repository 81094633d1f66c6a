"""What every service's entry point shares: common flags and the serve-until-signal loop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc
from prometheus_client import start_http_server

from llmserve.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES
from llmserve.logs import configure_logging, get_logger
from llmserve.security import add_security_flags, install, security_from_args
from llmserve.telemetry import setup_tracing, shutdown_tracing

log = get_logger(__name__)


def add_common_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port")
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)"
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message accepted or sent",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR",
    )
    parser.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON log lines (default: when stderr is not a terminal)",
    )
    add_security_flags(parser)


def start_service(service: str, args: argparse.Namespace) -> None:
    """Logging, credentials, tracing and the metrics endpoint, from the parsed common flags
    (the service's `validate` has already checked the credentials: see `check_security`)."""
    configure_logging(service, args.log_level, args.log_json)
    security = security_from_args(args)
    install(security)
    log.info(
        "security", tls=security.tls is not None, internal_token=bool(security.internal_tokens)
    )
    setup_tracing(f"llmserve-{service}")
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.host)
        log.info("metrics endpoint", url=f"http://{args.host}:{args.metrics_port}/metrics")


def keep_triton_out() -> None:
    """For a process that runs no Triton kernel (the gateway, the scheduler, a CPU worker):
    Triton looks absent, as with a CPU-only install of torch. Otherwise torch imports it by
    itself (torch._dynamo, which transformers touches) and nanobind reports hundreds of its
    objects as leaked at exit. Call before anything imports torch's compiler stack."""
    if "triton" not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment]  # imports fail, find_spec: None


def check_security(args: argparse.Namespace) -> None:
    """For each service's `validate`: ValueError naming the flag of a bad credential."""
    security_from_args(args)


def freeze_startup_heap() -> None:
    """Move everything allocated at start-up (model, tokenizer, modules) out of the cyclic
    GC's reach: later collections then scan only per-request objects, which keeps the
    scheduler's step loop free of long GC pauses."""
    gc.collect()
    gc.freeze()


async def serve_until_signal(
    server: grpc.aio.Server, on_stop: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Run until SIGINT/SIGTERM, then stop accepting calls, let in-flight ones finish briefly."""
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    if on_stop is not None:
        await on_stop()
    await server.stop(grace=3)
    shutdown_tracing()


def shard_addresses(text: str) -> list[str]:
    """The scheduler shards a `--scheduler` value names: distinct host:port addresses,
    comma-separated (one for an unsharded scheduler)."""
    shards = [a.strip() for a in text.split(",")]
    if not all(shards) or len(set(shards)) != len(shards):
        raise ValueError(f"--scheduler: distinct host:port addresses, comma-separated: {text!r}")
    return shards
