"""The gateway process: gRPC (llmserve.v1.Generation) and HTTP (OpenAI API) on one event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from llmserve.grpc_utils import create_server, set_serving
from llmserve.logs import get_logger
from llmserve.model_spec import ModelSource, resolve_model
from llmserve.service_main import serve_until_signal
from llmserve.v1 import generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    scheduler_address: str = "127.0.0.1:50071"
    model: str = "smollm2"
    served_model_name: str = "smollm2"
    max_model_len: int | None = None
    api_key: str | None = None
    max_pending_requests: int = 1024
    max_message_bytes: int = 64 * 1024 * 1024
    scheduler_reconnect_timeout_s: float = 60.0


def model_context_length(source: ModelSource) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path, **source.pretrained_kwargs())
    return int(getattr(config, "max_position_embeddings", 2048))


async def serve(config: GatewayConfig) -> None:
    from gateway.generation import GenerationCore
    from gateway.grpc_api import GenerationServicer
    from gateway.scheduler_client import SchedulerClient
    from gateway.tokenization import Tokenization

    source = resolve_model(config.model)
    tokenization = await asyncio.to_thread(Tokenization.for_model, source)
    max_model_len = await asyncio.to_thread(model_context_length, source)
    if config.max_model_len is not None:
        max_model_len = min(max_model_len, config.max_model_len)
    scheduler = SchedulerClient(
        config.scheduler_address, config.max_message_bytes, config.scheduler_reconnect_timeout_s
    )
    scheduler.start()
    core = GenerationCore(config.served_model_name, tokenization, scheduler, max_model_len)

    server, health = create_server([SERVICE_NAME], config.max_message_bytes)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core), server)
    address = f"{config.host}:{config.grpc_port}"
    server.add_insecure_port(address)
    await server.start()

    http_task = None
    if config.http_port:
        from gateway.openai_api import serve_http

        http_task = asyncio.create_task(serve_http(core, config))

    log.info("waiting for the scheduler", address=config.scheduler_address)
    await scheduler.wait_connected(timeout_s=3600)
    await set_serving(health, [SERVICE_NAME])
    log.info("gateway serving", grpc=address, http_port=config.http_port,
             model=config.served_model_name, max_model_len=max_model_len)

    async def on_stop() -> None:
        if http_task is not None:
            http_task.cancel()
            await asyncio.gather(http_task, return_exceptions=True)
        await scheduler.close()

    await serve_until_signal(server, on_stop)
