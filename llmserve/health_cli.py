"""`llmserve health ADDRESS`: one grpc.health.v1 Check, for container HEALTHCHECKs and scripts.

With TLS, it dials with the --tls-* flags, which default to the container's LLMSERVE_TLS_*
variables (health needs no token). Exits 0 when the service answers SERVING, 1 when it answers anything else or not at all,
with one line saying which. The image's HEALTHCHECK runs it against the container's own port.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import security


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving, what the service answered) for one Check call."""
    with security.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmserve health", description=__doc__)
    p.add_argument("address", help="host:port of a worker, scheduler or gateway")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = security.parse_cli_security(p, argv)
    serving, status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1
