"""Many simulated workers in one process, and a scheduler beside them, for tests and benchmarks.

Each simulated worker (tests/support/simulated_worker.py) is a real Worker gRPC server on a
loopback port the OS picks, served on the process's one event loop with a model thread of its
own (as `llmserve worker` runs one), and joins the scheduler with a lease
(`worker_service.membership.keep_lease`), as `llmserve worker --scheduler` does.

    python -m tests.support.simulated_fleet --scheduler 127.0.0.1:50071 --workers 16

The process prints one JSON line once every worker serves, {"ready": [addresses]}, then reads
commands on stdin, one a line, each answered by one JSON line on stdout:
    stats   the workers' pooled `SimulatedStats` since the previous `stats` (see `pool_stats`)
    quit    (or the end of stdin) stop every worker and exit
Logs go to stderr. `SimulatedFleetProcess` is the parent's side of this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmserve.grpc_utils import channel_options, create_server, set_serving
from llmserve.logs import configure_logging
from llmserve.ports import free_ports
from llmserve.supervisor import stop_process
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.simulated_worker import (
    SimulatedConfig,
    SimulatedStats,
    SimulatedWorker,
    StepTimeModel,
)
from worker_service.membership import keep_lease
from worker_service.server import WorkerServicer

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SimulatedServer:
    """One simulated worker and its server."""

    address: str
    worker: SimulatedWorker
    server: grpc.aio.Server
    model_thread: ThreadPoolExecutor
    lease: asyncio.Task[None] | None

    async def stop(self) -> None:
        if self.lease is not None:
            self.lease.cancel()
            await asyncio.gather(self.lease, return_exceptions=True)
        await self.server.stop(grace=0)
        self.model_thread.shutdown(wait=False)


async def serve_simulated(
    config: SimulatedConfig, scheduler: str | None, host: str = "127.0.0.1", port: int = 0
) -> SimulatedServer:
    """Start one simulated worker (on `port`, 0: one the OS picks); with `scheduler`, it
    registers there and keeps its lease."""
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="simulated")
    worker = SimulatedWorker(config)
    server, health = create_server([SERVICE_NAME])
    servicer = WorkerServicer(
        worker,  # type: ignore[arg-type]  # the servicer's view of a Worker, without torch
        config.num_gpu_blocks,
        config.num_cpu_blocks,
        model_thread,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await set_serving(health, [SERVICE_NAME])
    address = f"{host}:{port}"
    lease = None
    if scheduler:
        _, lease = keep_lease(servicer, scheduler, address)
    return SimulatedServer(address, worker, server, model_thread, lease)


def pool_stats(stats: list[SimulatedStats]) -> dict[str, Any]:
    """Totals over workers, and the forward gaps' distribution in milliseconds."""
    gaps = sorted(g for s in stats for g in s.gaps_ns)
    pooled: dict[str, Any] = {"workers": len(stats)}
    for key in ("steps", "forward_s", "overshoot_s", "tokens_computed", "tokens_sampled"):
        pooled[key] = sum(getattr(s, key) for s in stats)
    pooled["swapped_blocks"] = sum(s.swapped_blocks for s in stats)
    pooled["copied_blocks"] = sum(s.copied_blocks for s in stats)

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] / 1e6 if gaps else 0.0

    pooled["gap_ms"] = {
        "count": len(gaps),
        "mean": sum(gaps) / len(gaps) / 1e6 if gaps else 0.0,
        "p50": pct(0.5),
        "p99": pct(0.99),
        "max": gaps[-1] / 1e6 if gaps else 0.0,
    }
    return pooled


async def _serve_fleet(args: argparse.Namespace) -> int:
    config = SimulatedConfig(
        StepTimeModel(args.fixed_ms, args.per_token_ms),
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
    )
    shards = args.scheduler.split(",")
    servers = [await serve_simulated(config, shards[i % len(shards)]) for i in range(args.workers)]
    print(json.dumps({"ready": [s.address for s in servers]}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            command = line.strip()
            if not line or command == "quit":
                return 0
            if command == "stats":
                reply = pool_stats([s.worker.take_stats() for s in servers])
            else:
                reply = {"error": f"unknown command {command!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        await asyncio.gather(*(s.stop() for s in servers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.simulated_fleet", description=__doc__)
    p.add_argument(
        "--scheduler",
        required=True,
        help="host:port to register with; several comma-separated (shards): worker i registers "
        "with the (i mod count)-th, so that the shards get equal shares",
    )
    p.add_argument("--workers", type=int, default=1)
    defaults = SimulatedConfig()
    p.add_argument("--fixed-ms", type=float, default=defaults.step_time.fixed_ms)
    p.add_argument("--per-token-ms", type=float, default=defaults.step_time.per_token_ms)
    p.add_argument("--num-gpu-blocks", type=int, default=defaults.num_gpu_blocks)
    p.add_argument("--num-cpu-blocks", type=int, default=defaults.num_cpu_blocks)
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=defaults.vocab_size,
        help="tokens are sampled below this (a gateway's tokenizer must know them all)",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    configure_logging("simulated-workers", args.log_level)
    return asyncio.run(_serve_fleet(args))


# -- the parent's side ---------------------------------------------------------------------------


class SimulatedFleetProcess:
    """`num_workers` simulated workers in a child process, registered with `scheduler` (or,
    comma-separated, spread evenly over several shards)."""

    def __init__(
        self,
        scheduler: str,
        num_workers: int,
        log: Path,
        step_time: StepTimeModel | None = None,
        extra_args: list[str] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        step_time = step_time or StepTimeModel()
        args = [
            "--scheduler", scheduler, "--workers", str(num_workers),
            "--fixed-ms", str(step_time.fixed_ms), "--per-token-ms", str(step_time.per_token_ms),
            *(extra_args or []),
        ]  # fmt: skip
        self.log = log
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.support.simulated_fleet", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("ab"),
            cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            self.addresses: list[str] = self._reply(ready_timeout_s)["ready"]
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The workers' pooled stats since the previous call (counting starts again)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(b"stats\n")
        self.popen.stdin.flush()
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        out = self.popen.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else b""
        if not line:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"simulated workers did not answer in {timeout_s} s:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write(b"quit\n")
            self.popen.stdin.close()
            self.popen.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            stop_process(self.popen, grace_s=5)


@dataclass
class SchedulerProcess:
    """A real `llmserve scheduler` child process on a loopback port chosen at run time."""

    address: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        with grpc.insecure_channel(self.address, options=channel_options()) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10
            )

    def wait_ready(self, num_workers: int, timeout_s: float = 60.0) -> None:
        """Until `num_workers` replicas are READY."""
        deadline = time.monotonic() + timeout_s
        ready = 0
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"scheduler exited:\n{self.log.read_text()[-3000:]}")
            try:
                stats = self.stats()
                ready = sum(r.state == scheduler_pb2.WORKER_STATE_READY for r in stats.replicas)
                if ready >= num_workers:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{ready}/{num_workers} replicas ready after {timeout_s} s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            stop_process(self.popen, grace_s=30)


def start_scheduler(
    log: Path, args: list[str], launcher: list[str] | None = None
) -> SchedulerProcess:
    """`launcher` runs `llmserve` (default: this Python's `-m llmserve.cli`; the benchmark's
    profiler wraps it)."""
    (port,) = free_ports(1)
    command = launcher or [sys.executable, "-m", "llmserve.cli"]
    popen = subprocess.Popen(
        [*command, "scheduler", "--port", str(port), *args],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return SchedulerProcess(f"127.0.0.1:{port}", popen, log)


if __name__ == "__main__":
    sys.exit(main())
