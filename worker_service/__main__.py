"""`llmserve worker`: load the model, size the KV cache, serve the Worker gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

from llmserve import security
from llmserve.config_env import parse_service_args
from llmserve.config_flags import add_flags, flag_values
from llmserve.grpc_utils import create_server, set_serving
from llmserve.logs import get_logger
from llmserve.proto_convert import WORKER_ROLES
from llmserve.service_main import (
    add_common_flags,
    check_security,
    keep_triton_out,
    serve_until_signal,
    shard_addresses,
    start_service,
)
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.config import GiB, WorkerConfig
from worker_service.membership import WorkerDrain, keep_lease

log = get_logger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmserve worker", description=__doc__)
    add_common_flags(p, default_port=50061)
    add_flags(p, WorkerConfig)
    defaults = WorkerConfig()
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=defaults.kv_cache_memory_bytes / GiB,
        help="CPU KV cache size, GiB",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=defaults.swap_space_bytes / GiB,
        help="host swap space, GiB",
    )
    p.add_argument(
        "--role",
        choices=list(WORKER_ROLES),
        default="mixed",
        help="disaggregated serving: prefill workers prefill long prompts and hand each request "
        "to a decode worker with its KV blocks; decode workers decode them (and prefill short "
        "prompts); mixed workers do both",
    )
    p.add_argument(
        "--kv-send-rate-gbs",
        type=float,
        default=0.0,
        help="cap on the rate this worker sends KV blocks to peers at, GB/s (0: none): stands "
        "for a slower network in benchmarks",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        help="scheduler host:port to join with RegisterWorker, renewing the lease it grants "
        "for the worker's life; SIGTERM also asks it to DrainWorker. Several comma-separated "
        "(scheduler shards): the worker joins the one with the fewest workers, and another "
        "when that one is gone",
    )
    p.add_argument(
        "--advertise-address",
        default=None,
        help="host:port the scheduler should dial (default: --host:--port)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM, wait at most this long for the scheduler to move or finish this "
        "worker's requests, then exit (a second SIGTERM exits at once). Kubernetes: set "
        "terminationGracePeriodSeconds above it, or the kubelet kills the worker mid-drain",
    )
    return parse_service_args(p, argv, validate)


def validate(args: argparse.Namespace) -> None:
    """What --check-config checks beyond the parser: the config's own rules and the model."""
    from llmserve.errors import ModelNotFoundError
    from llmserve.model_spec import resolve_model

    build_config(args)
    check_security(args)
    if args.scheduler:
        shard_addresses(args.scheduler)
    try:
        resolve_model(args.model)
    except ModelNotFoundError as exc:
        raise ValueError(f"model: {exc}") from None


def build_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        kv_cache_memory_bytes=int(args.kv_cache_memory * GiB),
        swap_space_bytes=int(args.swap_space * GiB),
        **flag_values(WorkerConfig, args),
    )


async def serve(args: argparse.Namespace) -> int:
    from worker_service.server import WorkerServicer
    from worker_service.worker import Worker

    config = build_config(args)
    # Every call into the model, from construction on, runs on this one thread (see Worker).
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    loop = asyncio.get_running_loop()
    worker = await loop.run_in_executor(model_thread, Worker, config)
    log.info("loading model", model=config.model)
    await loop.run_in_executor(model_thread, worker.load_model)
    info = worker.model_info
    log.info(
        "model loaded",
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
        linear_impl=info.linear_impl,
        num_threads=info.num_threads,
    )
    num_gpu, num_cpu = await loop.run_in_executor(
        model_thread, worker.determine_num_available_blocks
    )
    log.info(
        "kv capacity",
        num_gpu_blocks=num_gpu,
        num_cpu_blocks=num_cpu,
        block_bytes=worker.get_cache_block_size_bytes(),
        max_num_seqs=worker.batch_limits.max_num_seqs,
        max_num_batched_tokens=worker.batch_limits.max_num_batched_tokens,
    )
    server, health = create_server(
        [SERVICE_NAME], args.max_message_bytes, security.internal_auth([SERVICE_NAME])
    )
    servicer = WorkerServicer(worker, num_gpu, num_cpu, model_thread)
    servicer.kv_send_rate = args.kv_send_rate_gbs * 1e9
    servicer.role = WORKER_ROLES[args.role]
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = f"{args.host}:{args.port}"
    security.add_port(server, address)
    await server.start()
    await set_serving(health, [SERVICE_NAME])
    log.info(
        "worker serving",
        address=address,
        model=config.model,
        device=str(worker.device),
        dtype=str(worker.dtype),
    )
    advertised = args.advertise_address or advertise_address(args.host, args.port)
    keeper = lease_task = None
    if args.scheduler:
        keeper, lease_task = keep_lease(servicer, shard_addresses(args.scheduler), advertised)
    drain = WorkerDrain(
        server,
        health,
        servicer,
        timeout_s=args.drain_timeout_s,
        advertised=advertised,
        lease_task=lease_task,
        keeper=keeper,
    )
    await serve_until_signal(server, drain.run)
    return drain.exit_code


def _may_use_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def advertise_address(host: str, port: int) -> str:
    """The address a scheduler dials to reach this worker: the listen address, unless that
    is a wildcard (a container listening on 0.0.0.0), then this host's own address."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.attention_backend != "triton" and not _may_use_cuda(args.device):
        keep_triton_out()
    start_service("worker", args)
    return asyncio.run(serve(args))
