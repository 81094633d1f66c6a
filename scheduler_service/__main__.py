"""`llmserve scheduler`: queues, block tables and the step loop of every worker replica."""

from __future__ import annotations

import argparse
import asyncio
import socket

from llmserve import security
from llmserve.batch_limits import add_batch_limit_flags
from llmserve.config_env import parse_service_args
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
from scheduler_service.engine.config import (
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    PreemptionMode,
    SchedulerConfig,
)
from scheduler_service.fleet.admission import (
    DEFAULT_MAX_WAITING_REQUESTS,
    SchedulerAdmission,
    drain,
)
from scheduler_service.fleet.fleet_config import (
    DEFAULT_PREFILL_LOCAL_BELOW,
    DEFAULT_PREFIX_FETCH_MIN_TOKENS,
    MigrationMode,
)

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
    add_batch_limit_flags(p, owner=True)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="lower every worker's max_model_len to this (default: the worker's, which its "
        "model and cache decide); a worker whose own is smaller is refused",
    )
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--forced-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="structured output: append the tokens a grammar forces as inputs of the next "
        "step instead of sampling them one at a time",
    )
    p.add_argument(
        "--forced-hold-tokens",
        type=int,
        default=8,
        help="with forced tokens on, asynchronous scheduling does not continue a step while "
        "one of its constrained sequences got forced tokens within its last this many tokens "
        "(0: always continue)",
    )
    p.add_argument(
        "--max-grammar-compile-ms",
        type=int,
        default=10_000,
        help="structured output: a grammar still compiling this long after its request "
        "arrived ends the request with 429 (the replica waits for it at most this long)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding: up to this many n-gram drafts per sequence and step, "
        "verified by the worker in the same pass (0: off)",
    )
    p.add_argument(
        "--ngram-min",
        type=int,
        default=DEFAULT_NGRAM_MIN,
        help="shortest suffix prompt lookup matches",
    )
    p.add_argument(
        "--ngram-max",
        type=int,
        default=DEFAULT_NGRAM_MAX,
        help="longest suffix prompt lookup matches (a match of n tokens drafts at most "
        "2 (n - 1) tokens)",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=16,
        help="drafts are given while a step's sequences and drafts stay within this many "
        "rows (the CPU worker's native decode step runs up to 16, 32 on GGUF blocks)",
    )
    p.add_argument(
        "--speculative-max-seqs",
        type=int,
        default=2,
        help="drafts are given only to steps of at most this many sequences (on a CPU a step "
        "of more is compute-bound: raise it for a GPU worker)",
    )
    p.add_argument(
        "--continue-after-drafts",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with asynchronous scheduling, build the step after one with drafts before its "
        "result, assuming every draft is kept (off: measured slower on a 2-core CPU)",
    )
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each decode step to the worker before the previous step's result is back, "
        "so the worker does not wait for the round trip and the scheduling (outputs are the "
        "same either way)",
    )
    # No --block-size: each replica takes its worker's block size from Info, the one source.
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="device KV blocks to ask each worker for, in place of what it offers",
    )
    p.add_argument("--num-cpu-blocks-override", type=int, default=None)
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
    fleet.add_argument(
        "--worker-dns",
        default="",
        help="host:port whose name is re-resolved every --dns-interval-s, one worker per "
        "address (a compose service scaled to N, a Kubernetes headless Service); several "
        "comma-separated (e.g. prefill and decode workers' services)",
    )
    fleet.add_argument("--dns-interval-s", type=float, default=5.0)
    fleet.add_argument(
        "--shard-name",
        default="",
        help="this scheduler's name when several share a fleet as shards (each driving its own "
        "workers): on its traces (llmserve.scheduler.shard), metrics "
        "(llmserve_scheduler_shard_info) and GetStats; default: its host name and port",
    )
    fleet.add_argument(
        "--worker-lease-s",
        type=float,
        default=10.0,
        help="workers that joined with RegisterWorker renew within this long or count as lost",
    )
    fleet.add_argument(
        "--routing",
        choices=["cache_aware", "least_loaded", "round_robin"],
        default="cache_aware",
        help="cache_aware weighs each worker's cached prefix of the prompt against its load",
    )
    fleet.add_argument(
        "--no-worker-timeout-s",
        type=float,
        default=30.0,
        help="a request waits this long for a ready worker, then fails UNAVAILABLE",
    )
    fleet.add_argument(
        "--step-watchdog-s",
        type=float,
        default=None,
        help="a step without a result after this long marks its worker lost (default: the "
        "larger of 30 s and 20x the slowest step seen)",
    )
    fleet.add_argument(
        "--health-interval-s",
        type=float,
        default=2.0,
        help="health checks of each worker; 3 failures in a row mark it lost",
    )
    fleet.add_argument(
        "--drain-grace-s",
        type=float,
        default=10.0,
        help="running requests of a draining worker that cannot move with their KV blocks "
        "may finish there for this long before they move by recompute",
    )
    fleet.add_argument(
        "--prefill-local-below",
        type=int,
        default=DEFAULT_PREFILL_LOCAL_BELOW,
        help="disaggregated serving (workers with --role): a prompt with fewer tokens than this "
        "not cached on a decode worker prefills there instead of on a prefill worker",
    )
    fleet.add_argument(
        "--prefix-fetch-min-tokens",
        type=int,
        default=DEFAULT_PREFIX_FETCH_MIN_TOKENS,
        help="a request placed on a worker that holds this many fewer of its prompt's tokens "
        "cached than another worker copies those KV blocks from there first, when the measured "
        "transfer and prefill rates say it is faster (0: never)",
    )
    fleet.add_argument(
        "--drain-migration",
        choices=[m.value for m in MigrationMode],
        default=MigrationMode.PRE_COPY.value,
        help="how a draining worker's running requests move: with their KV blocks, copied while "
        "they decode (pre-copy) or while they wait (stop-and-copy), or by recompute",
    )
    return parse_service_args(p, argv, validate)


def validate(args: argparse.Namespace) -> None:
    """What --check-config checks beyond the parser."""
    check_security(args)
    build_fleet_config(args)


def build_fleet_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
    from scheduler_service.fleet.placement import RoutingPolicy

    mode = None if args.preemption_mode == "auto" else PreemptionMode(args.preemption_mode)
    replica = ReplicaConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=mode,
            enable_forced_tokens=args.forced_tokens,
            forced_hold_tokens=args.forced_hold_tokens,
            max_grammar_compile_ms=args.max_grammar_compile_ms,
            num_speculative_tokens=args.num_speculative_tokens,
            ngram_min=args.ngram_min,
            ngram_max=args.ngram_max,
            speculative_max_batch=args.speculative_max_batch,
            speculative_max_seqs=args.speculative_max_seqs,
            continue_after_drafts=args.continue_after_drafts,
        ),
        watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        num_cpu_blocks_override=args.num_cpu_blocks_override,
        max_message_bytes=args.max_message_bytes,
        step_watchdog_s=args.step_watchdog_s,
        health_interval_s=args.health_interval_s,
        drain_grace_s=args.drain_grace_s,
        drain_migration=MigrationMode(args.drain_migration),
        async_scheduling=args.async_scheduling,
    )
    return FleetConfig(
        replica,
        routing=RoutingPolicy(args.routing),
        worker_dns=args.worker_dns,
        dns_interval_s=args.dns_interval_s,
        lease_s=args.worker_lease_s,
        no_worker_timeout_s=args.no_worker_timeout_s,
        shard=args.shard_name or f"{socket.gethostname()}:{args.port}",
        prefill_local_below=args.prefill_local_below,
        prefix_fetch_min_tokens=args.prefix_fetch_min_tokens,
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
