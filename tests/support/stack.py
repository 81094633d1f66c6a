"""The three services as real processes on loopback ports chosen at run time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.supervisor import free_ports, stop_process


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

    def stop(self) -> None:
        for name in ("gateway", "scheduler", "worker"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            stop_process(proc, grace_s=15)


def wait_healthy(address: str, proc: subprocess.Popen[bytes], name: str, log: Path,
                 timeout_s: float = 180.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """`credentials`: for services that serve TLS only."""
    deadline = time.monotonic() + timeout_s
    with (
        grpc.insecure_channel(address) if credentials is None
        else grpc.secure_channel(address, credentials)
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
    """Start worker, scheduler and gateway (in that order) and wait until each is SERVING."""
    picked = free_ports(6)
    ports = dict(zip(("worker", "scheduler", "gateway"), picked[:3], strict=True))
    metrics_ports = dict(zip(("worker", "scheduler"), picked[3:5], strict=True))
    stack = RunningStack(
        worker=f"127.0.0.1:{ports['worker']}",
        scheduler=f"127.0.0.1:{ports['scheduler']}",
        gateway=f"127.0.0.1:{ports['gateway']}",
        http_port=picked[5],
        metrics_ports=metrics_ports,
        log_dir=log_dir,
    )
    commands = {
        "worker": ["worker", "--model", model, "--port", str(ports["worker"]),
                   "--metrics-port", str(metrics_ports["worker"]),
                   "--kv-cache-memory", "0.05", "--swap-space", "0.05", "--num-threads", "1",
                   *(worker_args or [])],
        "scheduler": ["scheduler", "--port", str(ports["scheduler"]),
                      "--metrics-port", str(metrics_ports["scheduler"]),
                      "--workers", stack.worker, *(scheduler_args or [])],
        "gateway": ["gateway", "--model", model, "--port", str(ports["gateway"]),
                    "--http-port", str(stack.http_port), "--scheduler", stack.scheduler,
                    *(gateway_args or [])],
    }
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        for name, args in commands.items():
            log = log_dir / f"{name}.log"
            proc_env = {**base_env, **((envs or {}).get(name, {}))}
            stack.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "llmserve.cli", *args],
                stdout=log.open("wb"), stderr=subprocess.STDOUT, env=proc_env,
            )
            address = {"worker": stack.worker, "scheduler": stack.scheduler,
                       "gateway": stack.gateway}[name]
            wait_healthy(address, stack.procs[name], name, log, credentials=credentials)
    except BaseException:
        stack.stop()
        raise
    return stack
