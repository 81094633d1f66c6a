"""`llmserve up`: the whole stack on one machine, as separate processes on loopback.

Workers start first, then the scheduler (pointed at them; with `--schedulers N`, N shards,
each given its share of the workers), then the gateway (pointed at every shard). Each child's
output is prefixed with its name. Once the stack is up, a child that dies is started again on
the same ports, as a Deployment would, with a backoff that grows while it keeps dying: the
scheduler takes a restarted worker back at its address (and moves a dead worker's requests to
the others meanwhile), and the gateway re-submits its requests to a restarted scheduler (or,
with shards, at once to the others; the restarted shard takes its workers back).
Ctrl-C or SIGTERM stops every child, gateway first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.grpc_utils import wait_for_health
from llmserve.logs import get_logger
from llmserve.ports import LOOPBACK, free_port

log = get_logger(__name__)


def stop_process(
    proc: subprocess.Popen[bytes], grace_s: float, sig: signal.Signals = signal.SIGTERM
) -> None:
    """Send `sig` to a child started with Popen and wait up to `grace_s` for it to exit; kill
    it when it does not."""
    stop_processes([proc], grace_s, sig)


def stop_processes(
    procs: list[subprocess.Popen[bytes]], grace_s: float, sig: signal.Signals = signal.SIGTERM
) -> None:
    """`stop_process` for several children at once: each is sent `sig` (those still running),
    then all share one `grace_s` to exit; those left are killed."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    args: list[str]  # arguments to `python -m llmserve.cli`
    grpc_address: str
    # Set in this child's environment on top of ours (a worker's CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = field(default_factory=dict)


class DeviceAssignmentError(ValueError):
    """`llmserve up` cannot give its workers the devices they need."""


def assign_cuda_devices(num_workers: int, visible: list[str]) -> list[str | None]:
    """The CUDA device each worker gets (its CUDA_VISIBLE_DEVICES), from the devices this
    machine shows (`visible`, CUDA_VISIBLE_DEVICES order). None: no CUDA here, leave it.

    Each worker gets a device of its own. Workers never share one: a worker's memory
    profile gives its KV cache what is left of --gpu-memory-utilization of the whole device
    after everything else on it, the first worker's cache included, so a second worker on
    the same device would find no room. More workers than devices is refused."""
    if not visible:
        return [None] * num_workers
    if num_workers > len(visible):
        raise DeviceAssignmentError(
            f"--workers {num_workers} needs {num_workers} CUDA devices, this machine shows "
            f"{len(visible)} ({','.join(visible)}): workers do not share a device (each one's "
            "KV cache takes what its memory profile leaves of the whole device); run at most "
            f"{len(visible)} workers, or --device cpu"
        )
    return list(visible[:num_workers])


def visible_cuda_devices() -> list[str]:
    """The CUDA devices a child would see: CUDA_VISIBLE_DEVICES' entries, else every device
    torch counts (no torch or no CUDA: none)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@dataclass(frozen=True, slots=True)
class StackConfig:
    model: str = "smollm2"
    num_workers: int = 1
    # Scheduler shards; worker i is on shard i % num_schedulers (a static list each).
    num_schedulers: int = 1
    grpc_port: int = 50051
    http_port: int = 8000
    host: str = LOOPBACK
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    https: bool = False  # the gateway serves HTTPS (only for the banner)
    # Worker i runs with CUDA_VISIBLE_DEVICES=worker_devices[i] (None or absent: unchanged).
    worker_devices: list[str | None] = field(default_factory=list)
    # Worker i runs with --role worker_roles[i] (absent: the worker's default, mixed).
    worker_roles: list[str] = field(default_factory=list)


def plan_stack(config: StackConfig) -> list[ServiceSpec]:
    """The processes to start, in order, with the ports they will listen on."""
    specs: list[ServiceSpec] = []
    worker_addresses = []
    for index in range(config.num_workers):
        port = free_port()
        address = f"{LOOPBACK}:{port}"
        worker_addresses.append(address)
        device = config.worker_devices[index] if index < len(config.worker_devices) else None
        role = config.worker_roles[index : index + 1]
        specs.append(
            ServiceSpec(
                f"worker-{index}",
                [
                    "worker",
                    "--model",
                    config.model,
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--metrics-port",
                    str(free_port()),
                    *config.worker_args,
                    *(["--role", *role] if role else []),
                ],
                address,
                {"CUDA_VISIBLE_DEVICES": device} if device is not None else {},
            )
        )
    shards = []
    for index in range(config.num_schedulers):
        port = free_port()
        shards.append(f"{LOOPBACK}:{port}")
        sharded = config.num_schedulers > 1
        specs.append(
            ServiceSpec(
                f"scheduler-{index}" if sharded else "scheduler",
                [
                    "scheduler",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--metrics-port",
                    str(free_port()),
                    "--workers",
                    ",".join(worker_addresses[index :: config.num_schedulers]),
                    *(["--shard-name", f"scheduler-{index}"] if sharded else []),
                    *config.scheduler_args,
                ],
                shards[-1],
            )
        )
    specs.append(
        ServiceSpec(
            "gateway",
            [
                "gateway",
                "--model",
                config.model,
                "--host",
                config.host,
                "--port",
                str(config.grpc_port),
                "--http-port",
                str(config.http_port),
                "--scheduler",
                ",".join(shards),
                *config.gateway_args,
            ],
            f"{LOOPBACK}:{config.grpc_port}",
        )
    )
    return specs


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    prefix = f"[{name}] ".encode()
    while line := await stream.readline():
        sys.stderr.buffer.write(prefix + line)
        sys.stderr.buffer.flush()


# Seconds before the n-th restart in a row of a child that keeps dying (the last repeats).
_RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A child that ran this long before dying starts its backoff over.
_STABLE_AFTER_S = 60.0


class Stack:
    """Starts, watches, restarts and stops the child processes of `llmserve up`."""

    def __init__(self, specs: list[ServiceSpec]) -> None:
        self.specs = specs
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = {spec.name: 0 for spec in specs}
        self._pumps: list[asyncio.Task[None]] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False
        self._env = dict(os.environ)
        self._env.setdefault("PYTHONUNBUFFERED", "1")

    async def _spawn(self, spec: ServiceSpec) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmserve.cli",
            *spec.args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**self._env, **spec.env},
            start_new_session=True,
        )
        self.procs[spec.name] = proc
        assert proc.stdout is not None
        self._pumps.append(asyncio.create_task(_pump(spec.name, proc.stdout)))
        log.info("starting", service=spec.name, address=spec.grpc_address, pid=proc.pid, **spec.env)
        return proc

    async def start(self, timeout_s: float) -> None:
        for spec in self.specs:
            proc = await self._spawn(spec)
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

    def supervise(self, timeout_s: float) -> None:
        """From now on, restart every child that exits (until `stop`)."""
        for spec in self.specs:
            self._watchers.append(
                asyncio.create_task(self._watch(spec, timeout_s), name=f"watch-{spec.name}")
            )

    async def _watch(self, spec: ServiceSpec, timeout_s: float) -> None:
        failures_in_a_row = 0
        while True:
            proc = self.procs[spec.name]
            started = time.monotonic()
            code = await proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started >= _STABLE_AFTER_S:
                failures_in_a_row = 0
            delay = _RESTART_DELAYS_S[min(failures_in_a_row, len(_RESTART_DELAYS_S) - 1)]
            failures_in_a_row += 1
            self.restarts[spec.name] += 1
            log.warning(
                "service exited; restarting it",
                service=spec.name,
                exit_code=code,
                restart=self.restarts[spec.name],
                delay_s=delay,
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            proc = await self._spawn(spec)
            try:
                await self._wait_healthy(spec, proc, timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                log.warning("restarted service did not come up", service=spec.name, error=str(exc))

    async def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
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
        workers = ", ".join(s.grpc_address for s in stack.specs if s.name.startswith("worker"))
        shards = [s.grpc_address for s in stack.specs if s.name.startswith("scheduler")]
        # A worker is drained through its own shard: worker i is on shard i mod K.
        scheduler = shards[0] if len(shards) == 1 else "SHARD"
        http = "https" if config.https else "http"
        print(
            f"llmserve is up with model {config.model!r}\n"
            f"  gRPC   (llmserve.v1.Generation): {config.host}:{config.grpc_port}\n"
            f"  OpenAI HTTP API:                 {http}://{config.host}:{config.http_port}/v1\n"
            f"  metrics:                         {http}://{config.host}:{config.http_port}/metrics\n"
            f"  scheduler: {', '.join(shards)}, workers: {workers}\n"
            f"    (llmserve drain --scheduler {scheduler} WORKER takes one out)\n"
            f"Try: llmserve generate --chat 'What is the capital of France?'\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        stack.supervise(config.startup_timeout_s)
        await stop.wait()
        return 0
    except Exception as exc:
        log.error("stack failed to start", error=str(exc))
        return 1
    finally:
        await stack.stop()
