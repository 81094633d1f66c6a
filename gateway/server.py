"""The gateway process: gRPC (llmserve.v1.Generation) and HTTP (OpenAI API) on one event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1.health import HealthServicer

from gateway.admission import SCHEDULER_REQUESTS, Admission
from gateway.metrics import SHARD_REQUESTS
from gateway.readiness import SchedulerReadiness, ShardsReadiness
from gateway.scheduler_client import DEFAULT_RECONNECT_TIMEOUT_S
from llmserve import security
from llmserve.grpc_utils import create_server, set_serving
from llmserve.limits import RequestLimits
from llmserve.logs import get_logger
from llmserve.model_spec import resolve_model
from llmserve.security import AuthInterceptor, KeySet
from llmserve.service_main import serve_until_signal, shard_addresses
from llmserve.v1 import generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    # One scheduler's host:port, or several shards' separated by commas.
    scheduler_address: str = "127.0.0.1:50071"
    model: str = "smollm2"
    served_model_name: str = "smollm2"
    api_keys: KeySet = field(default_factory=KeySet)  # empty: no key required
    tls_require_client_cert: bool = True
    # Generation requests in flight (HTTP and gRPC together) before new ones get 429 /
    # RESOURCE_EXHAUSTED.
    max_pending_requests: int = 1024
    max_message_bytes: int = 64 * 1024 * 1024
    scheduler_reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Longest a request may take (None: no limit); a gRPC client's deadline may be shorter.
    request_timeout_s: float | None = None
    # On SIGTERM, requests in flight have this long to finish before the gateway exits.
    shutdown_grace_s: float = 30.0
    # A Jinja chat template replacing the tokenizer's (read from --chat-template FILE).
    chat_template: str | None = None
    # --tool-call-parser: a format of gateway/tool_formats/, or "auto" (read off the template).
    tool_call_parser: str = "auto"
    # --reasoning-parser: a format of gateway/reasoning/, "none", or "auto".
    reasoning_parser: str = "auto"
    # --default-chat-template-kwargs: variables every chat template rendering gets.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # --thinking-token-budget: a chat's thinking budget when it names none (None: no bound).
    thinking_token_budget: int | None = None

    @property
    def scheduler_addresses(self) -> list[str]:
        """The scheduler shards (one address when the scheduler is not sharded)."""
        return shard_addresses(self.scheduler_address)


async def serve(config: GatewayConfig) -> None:
    from gateway.generation import GenerationCore
    from gateway.grpc_api import GenerationServicer
    from gateway.scheduler_client import SchedulerClient
    from gateway.tokenization import Tokenization

    source = resolve_model(config.model)
    tokenization = await asyncio.to_thread(
        Tokenization.for_model,
        source,
        config.chat_template,
        config.tool_call_parser,
        config.reasoning_parser,
        config.default_chat_template_kwargs,
        config.thinking_token_budget,
    )
    log.info("tool calls", format=tokenization.tool_format.name)
    reasoning = tokenization.reasoning_format
    log.info("reasoning", format="none" if reasoning is None else reasoning.name)
    shards = config.scheduler_addresses
    scheduler = SchedulerClient(
        shards, config.max_message_bytes, config.scheduler_reconnect_timeout_s
    )
    scheduler.start()
    admission = Admission(config.max_pending_requests)
    SCHEDULER_REQUESTS.set_function(lambda: scheduler.num_requests)
    for address in shards:
        SHARD_REQUESTS.labels(address).set_function(
            functools.partial(scheduler.shard_load, address)
        )
    core = GenerationCore(
        config.served_model_name,
        tokenization,
        scheduler,
        limits=config.limits,
        admission=admission,
        request_timeout_s=config.request_timeout_s,
    )

    def learned(max_model_len: int) -> None:
        if max_model_len != core.max_model_len:
            log.info("max_model_len from the scheduler", max_model_len=max_model_len)
        core.max_model_len = max_model_len

    readiness = ShardsReadiness(
        [
            SchedulerReadiness(
                address,
                functools.partial(scheduler.shard_connected, address),
                on_max_model_len=learned,
                on_change=scheduler.move_off_idle_shards,
            )
            for address in shards
        ]
    )
    scheduler.is_serving = readiness.serving
    readiness.start()

    auth = [AuthInterceptor(config.api_keys, [SERVICE_NAME])] if len(config.api_keys) else []
    server, health = create_server([SERVICE_NAME], config.max_message_bytes, auth)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core), server)
    address = f"{config.host}:{config.grpc_port}"
    security.add_port(server, address, config.tls_require_client_cert)
    published = PublishedReadiness()
    http = None
    if config.http_port:
        # Imported before either port opens: importing the HTTP stack takes seconds of the
        # event loop, during which gRPC could not answer.
        from gateway.openai_api import http_server

        http = http_server(core, config, published.not_ready_reason)
    await set_serving(health, [SERVICE_NAME], False)
    await server.start()
    http_task = None if http is None else asyncio.create_task(http.serve(), name="gateway-http")

    def reason() -> str | None:
        if http is not None and not http.started:
            return "starting: the HTTP port is not open yet"
        return readiness.not_ready_reason()

    health_task = asyncio.create_task(published.follow(reason, health), name="gateway-readiness")

    log.info(
        "gateway listening",
        grpc=address,
        http_port=config.http_port,
        model=config.served_model_name,
        scheduler=config.scheduler_address,
        shards=len(shards),
    )

    async def on_stop() -> None:
        # Draining: probes see NOT_SERVING / 503 at once, so traffic stops coming here; new
        # requests are refused (503 / UNAVAILABLE) and those in flight may finish.
        readiness.drain()
        await health.enter_graceful_shutdown()
        published.drain()
        admission.start_draining()
        in_flight = admission.in_flight
        log.info("draining", in_flight=in_flight, grace_s=config.shutdown_grace_s)
        drained = await admission.wait_idle(config.shutdown_grace_s)
        log.info(
            "drained" if drained else "grace period over; cutting the rest",
            finished=in_flight - admission.in_flight,
            cut=admission.in_flight,
        )
        for task in (health_task, http_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await readiness.close()
        await scheduler.close()

    await serve_until_signal(server, on_stop)


class PublishedReadiness:
    """The gateway's one readiness: gRPC health and HTTP `/ready` both answer from it, and it
    changes gRPC first, so whoever sees `/ready` say ok finds gRPC SERVING too. Neither says
    ready before both ports listen."""

    def __init__(self) -> None:
        self._reason: str | None = "starting"

    def not_ready_reason(self) -> str | None:
        """None when ready (HTTP `/ready`'s answer)."""
        return self._reason

    def drain(self) -> None:
        """`/ready` says 503 at once (gRPC health has been set NOT_SERVING)."""
        self._reason = "draining"

    async def follow(self, reason: Callable[[], str | None], health: HealthServicer) -> None:
        """Publish `reason()`, polled: it has several inputs (the ports, the scheduler's
        health, the Connect stream), and a check every 0.2 s is cheap."""
        while True:
            now = reason()
            if now != self._reason:
                if (now is None) != (self._reason is None):
                    await set_serving(health, [SERVICE_NAME], now is None)
                    log.info("gateway readiness", ready=now is None, reason=now)
                self._reason = now
            await asyncio.sleep(0.2)
