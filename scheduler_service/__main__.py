"""`llmserve scheduler`: queues, block tables and the step loop of every worker replica."""

from __future__ import annotations

import argparse
import asyncio

from llmserve.grpc_utils import create_server, set_serving
from llmserve.logs import get_logger
from llmserve.service_main import add_common_flags, serve_until_signal, start_service
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_service.config import PreemptionMode, SchedulerConfig

log = get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmserve scheduler", description=__doc__)
    add_common_flags(p, default_port=50071)
    p.add_argument(
        "--workers",
        default="",
        help="comma-separated worker addresses (host:port); workers may also join "
        "later with RegisterWorker",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="cap on prompt + output tokens (the worker's model limit also applies)",
    )
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="accepted for symmetry with the worker; the worker's block size is used",
    )
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--num-cpu-blocks-override", type=int, default=None)
    return p.parse_args(argv)


def build_replica_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from scheduler_service.replica import ReplicaConfig

    mode = None if args.preemption_mode == "auto" else PreemptionMode(args.preemption_mode)
    return ReplicaConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=mode,
        ),
        watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        num_cpu_blocks_override=args.num_cpu_blocks_override,
        max_message_bytes=args.max_message_bytes,
    )


async def serve(args: argparse.Namespace) -> None:
    from scheduler_service.server import Router, SchedulerServicer

    router = Router(build_replica_config(args))
    server, health = create_server([SERVICE_NAME], args.max_message_bytes)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(router), server)
    address = f"{args.host}:{args.port}"
    server.add_insecure_port(address)
    await server.start()
    for worker in filter(None, (w.strip() for w in args.workers.split(","))):
        router.add_replica(worker)
    await set_serving(health, [SERVICE_NAME])
    log.info("scheduler serving", address=address, workers=args.workers)
    await serve_until_signal(server, router.stop)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    start_service("scheduler", args)
    asyncio.run(serve(args))
    return 0
