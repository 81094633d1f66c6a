"""`llmserve up`: the whole stack on one machine, as separate processes on loopback.

Workers start first, then the scheduler (pointed at them), then the gateway. Each child's
output is prefixed with its name. Ctrl-C or SIGTERM stops every child, gateway first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from llmserve.grpc_utils import wait_for_health
from llmserve.logs import get_logger

log = get_logger(__name__)

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that were free a moment ago. All are held until all are picked:
    picking one at a time, the OS may hand out a port it has just released again."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    args: list[str]  # arguments to `python -m llmserve.cli`
    grpc_address: str


@dataclass(frozen=True, slots=True)
class StackConfig:
    model: str = "smollm2"
    num_workers: int = 1
    grpc_port: int = 50051
    http_port: int = 8000
    host: str = LOOPBACK
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0


def plan_stack(config: StackConfig) -> list[ServiceSpec]:
    """The processes to start, in order, with the ports they will listen on."""
    specs: list[ServiceSpec] = []
    worker_addresses = []
    for index in range(config.num_workers):
        port = free_port()
        address = f"{LOOPBACK}:{port}"
        worker_addresses.append(address)
        specs.append(
            ServiceSpec(
                f"worker-{index}",
                ["worker", "--model", config.model, "--host", LOOPBACK, "--port", str(port),
                 "--metrics-port", str(free_port()), *config.worker_args],
                address,
            )
        )
    scheduler_port = free_port()
    specs.append(
        ServiceSpec(
            "scheduler",
            ["scheduler", "--host", LOOPBACK, "--port", str(scheduler_port),
             "--metrics-port", str(free_port()), "--workers", ",".join(worker_addresses),
             *config.scheduler_args],
            f"{LOOPBACK}:{scheduler_port}",
        )
    )
    specs.append(
        ServiceSpec(
            "gateway",
            ["gateway", "--model", config.model, "--host", config.host,
             "--port", str(config.grpc_port), "--http-port", str(config.http_port),
             "--scheduler", f"{LOOPBACK}:{scheduler_port}", *config.gateway_args],
            f"{LOOPBACK}:{config.grpc_port}",
        )
    )
    return specs


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    prefix = f"[{name}] ".encode()
    while line := await stream.readline():
        sys.stderr.buffer.write(prefix + line)
        sys.stderr.buffer.flush()


class Stack:
    """Starts, watches and stops the child processes of `llmserve up`."""

    def __init__(self, specs: list[ServiceSpec]) -> None:
        self.specs = specs
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for spec in self.specs:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmserve.cli", *spec.args,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env=env, start_new_session=True,
            )
            self.procs[spec.name] = proc
            assert proc.stdout is not None
            self._pumps.append(asyncio.create_task(_pump(spec.name, proc.stdout)))
            log.info("starting", service=spec.name, address=spec.grpc_address, pid=proc.pid)
            await self._wait_healthy(spec, proc, timeout_s)

    async def _wait_healthy(
        self, spec: ServiceSpec, proc: asyncio.subprocess.Process, timeout_s: float
    ) -> None:
        health = asyncio.create_task(wait_for_health(spec.grpc_address, timeout_s))
        exited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait({health, exited}, return_when=asyncio.FIRST_COMPLETED)
        if exited in done:
            health.cancel()
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} during start-up")
        exited.cancel()
        health.result()
        log.info("healthy", service=spec.name, address=spec.grpc_address)

    async def wait_any_exit(self) -> str:
        waits = {asyncio.create_task(p.wait()): name for name, p in self.procs.items()}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waits[next(iter(done))]

    async def stop(self, grace_s: float = 10.0) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.returncode is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                log.warning("killing", service=name, after_s=grace_s)
                proc.kill()
                await proc.wait()
        for pump in self._pumps:
            pump.cancel()


async def run_stack(config: StackConfig) -> int:
    stack = Stack(plan_stack(config))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        start = asyncio.create_task(stack.start(config.startup_timeout_s))
        stopper = asyncio.create_task(stop.wait())
        first: set[asyncio.Task[Any]] = {start, stopper}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            start.cancel()
            return 130
        stopper.cancel()
        start.result()
        print(
            f"llmserve is up with model {config.model!r}\n"
            f"  gRPC   (llmserve.v1.Generation): {config.host}:{config.grpc_port}\n"
            f"  OpenAI HTTP API:                 http://{config.host}:{config.http_port}/v1\n"
            f"  metrics:                         http://{config.host}:{config.http_port}/metrics\n"
            f"Try: llmserve generate --chat 'What is the capital of France?'\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        exit_wait = asyncio.create_task(stack.wait_any_exit())
        stopper = asyncio.create_task(stop.wait())
        waiters: set[asyncio.Task[Any]] = {exit_wait, stopper}
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if exit_wait in done:
            log.error("a service exited; stopping the stack", service=exit_wait.result())
            return 1
        stopper.cancel()
        exit_wait.cancel()
        return 0
    except Exception as exc:
        log.error("stack failed to start", error=str(exc))
        return 1
    finally:
        await stack.stop()
