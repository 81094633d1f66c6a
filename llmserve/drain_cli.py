"""`llmserve drain WORKER`: take one worker out of the fleet without failing a request.

The scheduler stops routing to the worker, moves its waiting and swapped requests to the
other workers at once, lets its running requests finish there for `--drain-grace-s`, then
moves the rest; once the replica is empty it leaves the fleet (see `Replica.drain`). SIGTERM
on a worker process does the same from the worker's side.

DrainWorker is an internal call: give the scheduler's credential (the --tls-* flags and
--internal-token-file, or their LLMSERVE_* variables).
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from llmserve import security
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmserve drain", description=__doc__)
    p.add_argument("worker", help="the worker's host:port, as the scheduler lists it")
    p.add_argument("--scheduler", default="127.0.0.1:50071", help="the scheduler's gRPC host:port")
    p.add_argument("--wait", action="store_true", help="return once the worker has left the fleet")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the longest --wait waits")
    return security.parse_cli_security(p, argv)


def _wait_gone(
    stub: scheduler_pb2_grpc.SchedulerStub, worker: str, timeout_s: float
) -> float | None:
    """Seconds until `worker` left the scheduler's replicas, or None after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        if all(r.address != worker for r in stats.replicas):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with security.channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            reply = stub.DrainWorker(
                scheduler_pb2.DrainWorkerRequest(address=args.worker), timeout=10
            )
            print(
                f"draining {args.worker} (replica {reply.replica_id}, "
                f"{reply.num_requests} requests on it)",
                flush=True,
            )
            if not args.wait:
                return 0
            seconds = _wait_gone(stub, args.worker, args.timeout_s)
        except grpc.RpcError as exc:
            print(f"llmserve drain: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if seconds is None:
        print(
            f"llmserve drain: {args.worker} still in the fleet after {args.timeout_s:g} s",
            file=sys.stderr,
        )
        return 1
    print(f"{args.worker} drained in {seconds:.1f} s")
    return 0
