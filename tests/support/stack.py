"""The three services as real processes on loopback ports chosen at run time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.grpc_utils import PROMPT_RECONNECT
from llmserve.ports import free_ports
from llmserve.supervisor import stop_process

# The model name that the gateway of the shared tiny stack (tests/integration/conftest.py,
# `tiny_stack`) serves.
TINY_SERVED_NAME = "tiny"


@dataclass
class RunningStack:
    worker: str
    scheduler: str
    gateway: str
    http_port: int
    metrics_ports: dict[str, int]
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def logs(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP the service `name` for the body, SIGCONT it after: no step finishes while
        its worker is paused, so a deadline passes before any request can finish, however
        fast the machine."""
        pid = self.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        for name in ("gateway", "scheduler", "worker"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            stop_process(proc, grace_s=15)


def wait_healthy(
    address: str,
    proc: subprocess.Popen[bytes],
    name: str,
    log: Path,
    timeout_s: float = 180.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """`credentials`: for services that serve TLS only."""
    deadline = time.monotonic() + timeout_s
    with (
        grpc.insecure_channel(address, options=PROMPT_RECONNECT)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=PROMPT_RECONNECT)
    ) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{name} not healthy in {timeout_s} s:\n{log.read_text()[-3000:]}")


# A port picked free can be taken before the service binds it (by another test's process;
# free_ports keeps out of the ephemeral range, so an outgoing connection cannot take it where
# the kernel leaves room below that range): the service exits with this in its log, and is
# started again on new ports, up to this many times in all.
_BIND_FAILED = "address already in use"
_ATTEMPTS = 3


def start_stack(
    model: str,
    log_dir: Path,
    *,
    worker_args: list[str] | None = None,
    scheduler_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    envs: dict[str, dict[str, str]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> RunningStack:
    """Start worker and gateway, then (the worker SERVING) the scheduler, and wait until each
    is SERVING. A service that finds its port taken is started again on new ports."""
    picked = free_ports(6)
    stack = RunningStack(
        worker=f"127.0.0.1:{picked[0]}",
        scheduler=f"127.0.0.1:{picked[1]}",
        gateway=f"127.0.0.1:{picked[2]}",
        http_port=picked[5],
        metrics_ports={"worker": picked[3], "scheduler": picked[4]},
        log_dir=log_dir,
    )

    def command(name: str) -> list[str]:  # from the stack's ports as they are now
        if name == "worker":
            return [
                "worker",
                "--model",
                model,
                "--port",
                _port(stack.worker),
                "--metrics-port",
                str(stack.metrics_ports["worker"]),
                "--kv-cache-memory",
                "0.05",
                "--swap-space",
                "0.05",
                "--num-threads",
                "1",
                *(worker_args or []),
            ]
        if name == "scheduler":
            return [
                "scheduler",
                "--port",
                _port(stack.scheduler),
                "--metrics-port",
                str(stack.metrics_ports["scheduler"]),
                "--workers",
                stack.worker,
                *(scheduler_args or []),
            ]
        return [
            "gateway",
            "--model",
            model,
            "--port",
            _port(stack.gateway),
            "--http-port",
            str(stack.http_port),
            "--scheduler",
            stack.scheduler,
            *(gateway_args or []),
        ]

    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}

    def launch(name: str) -> None:
        previous = stack.procs.get(name)
        if previous is not None and previous.poll() is None:
            stop_process(previous, grace_s=5)
        stack.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", *command(name)],
            stdout=(log_dir / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env={**base_env, **((envs or {}).get(name, {}))},
        )

    def settle(name: str) -> None:
        """Wait until `name` is SERVING, starting it again on new ports if its were taken."""
        log = log_dir / f"{name}.log"
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                address = getattr(stack, name)
                wait_healthy(address, stack.procs[name], name, log, credentials=credentials)
                return
            except RuntimeError:
                if attempt == _ATTEMPTS or _BIND_FAILED not in log.read_text(errors="replace"):
                    raise
                _repick_ports(stack, name)
                launch(name)
                if name == "scheduler":  # the gateway was given the scheduler's old port
                    launch("gateway")

    try:
        # The gateway starts beside the worker: it follows the scheduler's readiness, so its
        # start (imports, tokenizer) need not wait for the model's load.
        launch("worker")
        launch("gateway")
        settle("worker")
        launch("scheduler")
        settle("scheduler")
        settle("gateway")
    except BaseException:
        stack.stop()
        raise
    return stack


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def _repick_ports(stack: RunningStack, name: str) -> None:
    """New ports for service `name`'s listeners (its gRPC port and its metrics or HTTP port)."""
    port, other = free_ports(2)
    setattr(stack, name, f"127.0.0.1:{port}")
    if name == "gateway":
        stack.http_port = other
    else:
        stack.metrics_ports[name] = other
