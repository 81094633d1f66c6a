"""`llmserve scheduler`: queues, block tables and the step loop of every worker replica."""

from __future__ import annotations

import argparse
import asyncio
import socket

from llmserve import security
from llmserve.config_env import parse_service_args
from llmserve.config_flags import add_flags, flag_values
from llmserve.grpc_utils import create_server, set_serving
from llmserve.logs import get_logger
from llmserve.service_main import (
    add_common_flags,
    check_security,
    serve_until_signal,
    start_service,
)
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_service.engine import metrics
from scheduler_service.engine.config import PreemptionMode, SchedulerConfig
from scheduler_service.fleet.admission import (
    DEFAULT_MAX_WAITING_REQUESTS,
    SchedulerAdmission,
    drain,
)
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig

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
    add_flags(p, SchedulerConfig)
    p.add_argument(
        "--preemption-mode",
        choices=["auto", "recompute", "swap"],
        default="auto",
        help="auto: recompute a group with one live sequence, swap one with several",
    )
    # No --block-size: each replica takes its worker's block size from Info, the one source.
    add_flags(p, ReplicaConfig)
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests admitted but not yet running (all workers); beyond it a new request "
        "is refused at once with RESOURCE_EXHAUSTED (the gateway's 429)",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM: health turns NOT_SERVING, new requests get UNAVAILABLE, and those "
        "in flight have this long to finish",
    )
    fleet = p.add_argument_group("fleet", "worker membership, failure handling and routing")
    add_flags(fleet, FleetConfig)
    fleet.add_argument(
        "--shard-name",
        default="",
        help="this scheduler's name when several share a fleet as shards (each driving its own "
        "workers): on its traces (llmserve.scheduler.shard), metrics "
        "(llmserve_scheduler_shard_info) and GetStats; default: its host name and port",
    )
    return parse_service_args(p, argv, validate)


def validate(args: argparse.Namespace) -> None:
    """What --check-config checks beyond the parser."""
    check_security(args)
    build_fleet_config(args)


def build_fleet_config(args: argparse.Namespace) -> FleetConfig:
    mode = None if args.preemption_mode == "auto" else PreemptionMode(args.preemption_mode)
    scheduler = SchedulerConfig(**flag_values(SchedulerConfig, args), preemption_mode=mode)
    replica = ReplicaConfig(
        scheduler=scheduler,
        max_message_bytes=args.max_message_bytes,
        **flag_values(ReplicaConfig, args),
    )
    return FleetConfig(
        replica,
        shard=args.shard_name or f"{socket.gethostname()}:{args.port}",
        **flag_values(FleetConfig, args),
    )


async def serve(args: argparse.Namespace) -> None:
    from scheduler_service.fleet.server import Router, SchedulerServicer

    server, health = create_server(
        [SERVICE_NAME], args.max_message_bytes, security.internal_auth([SERVICE_NAME])
    )

    def on_ready_change(ready: bool) -> None:
        # SERVING only while at least one worker replica is ready to take requests.
        asyncio.get_running_loop().create_task(set_serving(health, [SERVICE_NAME], ready))

    config = build_fleet_config(args)
    metrics.SHARD_INFO.labels(config.shard).set(1)
    router = Router(config, on_ready_change, SchedulerAdmission(args.max_waiting_requests))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(router), server)
    address = f"{args.host}:{args.port}"
    security.add_port(server, address)
    await set_serving(health, [SERVICE_NAME], False)
    await server.start()
    router.start([w.strip() for w in args.workers.split(",") if w.strip()])
    log.info("scheduler listening", address=address, workers=args.workers, shard=config.shard)

    async def on_stop() -> None:
        # NOT_SERVING from the first moment of the drain, for good: no later ready change
        # of the fleet may turn it back to SERVING.
        await health.enter_graceful_shutdown()
        router.admission.draining = True
        log.info("draining", requests=len(router.routes), grace_s=args.shutdown_grace_s)
        finished, left = await drain(lambda: len(router.routes), args.shutdown_grace_s)
        log.info(
            "drained" if not left else "grace period over; aborting the rest",
            finished=finished,
            aborted=left,
            refused_while_draining=router.admission.num_refused,
        )
        await router.stop()

    await serve_until_signal(server, on_stop)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    start_service("scheduler", args)
    asyncio.run(serve(args))
    return 0
