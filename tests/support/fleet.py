"""A fleet stack for failure tests: N workers, a scheduler and a gateway as real processes on
loopback, each of which a test can kill, restart or add to, plus a mixed streaming workload
whose every token and logprob is recorded as the client receives it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmserve.client import build_request
from llmserve.grpc_utils import channel_options
from llmserve.ports import free_ports
from llmserve.supervisor import stop_process, stop_processes
from llmserve.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.stack import wait_healthy

WORKER_ARGS = ["--kv-cache-memory", "0.02", "--swap-space", "0.02", "--num-threads", "1"]


@dataclass
class Proc:
    name: str
    args: list[str]
    address: str
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", *self.args],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        if wait:
            wait_healthy(self.address, self.popen, self.name, self.log)

    def kill(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        stop_process(self.popen, grace_s=20)


@dataclass
class FleetStack:
    model: str
    log_dir: Path
    scheduler_args: list[str]
    env: dict[str, str]
    worker_args: list[str] = field(default_factory=lambda: list(WORKER_ARGS))
    workers: list[Proc] = field(default_factory=list)
    # The scheduler shards (one unless start_fleet was asked for more); `scheduler` is the first.
    schedulers: list[Proc] = field(default_factory=list)
    scheduler: Proc | None = None
    gateway: Proc | None = None
    http_port: int = 0
    # The internal token every service accepts (LLMSERVE_INTERNAL_TOKEN); "" for none.
    token: str = ""
    # Leases the test holds for workers it registered (`lease`); closed by `stop`.
    leases: list[Lease] = field(default_factory=list)

    def lease(self, address: str) -> Lease:
        """Register the worker at `address` and renew its lease until `stop`."""
        self.leases.append(Lease(self, address))
        return self.leases[-1]

    @property
    def metadata(self) -> list[tuple[str, str]] | None:
        """What the test's own calls to the scheduler carry: the internal token, if any."""
        return [("authorization", f"Bearer {self.token}")] if self.token else None

    def add_worker(
        self,
        wait: bool = True,
        args: list[str] = (),  # type: ignore[assignment]
        env: dict[str, str] | None = None,
    ) -> Proc:
        port, metrics_port = free_ports(2)
        assert self.scheduler is not None
        index = len(self.workers)
        proc = Proc(
            f"worker-{index}",
            [
                "worker",
                "--model",
                self.model,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--scheduler",
                self.scheduler_addresses,
                *self.worker_args,
                *args,
            ],
            f"127.0.0.1:{port}",
            self.log_dir / f"worker-{index}.log",
            {**self.env, **(env or {})},
        )
        self.workers.append(proc)
        proc.start(wait)
        return proc

    @property
    def scheduler_addresses(self) -> str:
        """The --scheduler value of workers and gateway: every shard, comma-separated."""
        return ",".join(s.address for s in self.schedulers)

    def stats(self, scheduler: Proc | None = None) -> scheduler_pb2.GetStatsResponse:
        """GetStats, with every replica's block accounting checked (invariant_violation)."""
        scheduler = scheduler or self.scheduler
        assert scheduler is not None
        with grpc.insecure_channel(scheduler.address) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(check_invariants=True),
                timeout=5,
                metadata=self.metadata,
            )

    def drain(self, address: str) -> int:
        """DrainWorker on the first scheduler; returns the requests the replica had."""
        assert self.scheduler is not None
        with grpc.insecure_channel(self.scheduler.address) as channel:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).DrainWorker(
                scheduler_pb2.DrainWorkerRequest(address=address),
                timeout=10,
                metadata=self.metadata,
            )
        return reply.num_requests

    def wait_for(
        self,
        predicate: Callable[[scheduler_pb2.GetStatsResponse], bool],
        what: str,
        timeout_s: float = 60.0,
        scheduler: Proc | None = None,
    ) -> scheduler_pb2.GetStatsResponse:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stats = self.stats(scheduler)
                if predicate(stats):
                    return stats
            except grpc.RpcError:
                stats = None
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last stats: {stats}")
            time.sleep(0.2)

    def ready_replicas(
        self, stats: scheduler_pb2.GetStatsResponse
    ) -> list[scheduler_pb2.ReplicaStats]:
        return [r for r in stats.replicas if r.state == scheduler_pb2.WORKER_STATE_READY]

    def assert_no_leak(self, scheduler: Proc | None = None) -> None:
        """Every ready replica of `scheduler` (default: the first) ends with free == total
        blocks (device and host) and state slots, no transfer holding blocks, and its block
        accounting's invariants holding."""

        def idle(stats: scheduler_pb2.GetStatsResponse) -> bool:
            return stats.num_unfinished_requests == 0 and all(
                r.gpu_blocks_free == r.gpu_blocks_total
                and r.cpu_blocks_free == r.cpu_blocks_total
                and r.state_slots_free == r.state_slots_total
                and r.num_transfers == 0
                for r in self.ready_replicas(stats)
            )

        stats = self.wait_for(idle, "every block free", timeout_s=30, scheduler=scheduler)
        assert self.ready_replicas(stats), stats
        assert all(not r.invariant_violation for r in stats.replicas), stats

    def assert_windows_hold_little(self, window: int, block_size: int) -> None:
        """Mid-run, on every ready replica with running requests: each windowed KV group holds
        at most a window's blocks (and a prefill chunk's) per running sequence, far fewer than
        its full group, which holds every token's. Blocks outside the windows were freed."""
        stats = self.stats()
        replicas = [r for r in self.ready_replicas(stats) if r.num_running]
        assert replicas, stats
        for replica in replicas:
            full = [g.blocks_used for g in replica.kv_groups if not g.HasField("sliding_window")]
            windowed = [g for g in replica.kv_groups if g.HasField("sliding_window")]
            assert full and windowed, replica
            # Running sequences: at least the requests (n=2 ones hold two, but share).
            bound = 2 * replica.num_running * (-(-(window - 1) // block_size) + 2)
            for group in windowed:
                assert group.sliding_window == window
                assert 0 < group.blocks_used <= bound, (group, bound, replica)
                assert group.blocks_used < min(full) / 2, replica

    def stop(self) -> None:
        """Gateway, then the schedulers, then the workers; each group signalled at once."""
        for lease in self.leases:
            lease.close()
        for group in ([self.gateway], self.schedulers, self.workers):
            stop_processes([p.popen for p in group if p is not None and p.popen], grace_s=20)


def start_fleet(
    model: str,
    log_dir: Path,
    num_workers: int,
    *,
    scheduler_args: list[str] = (),  # type: ignore[assignment]
    worker_args: list[str] = WORKER_ARGS,  # noqa: B006 (never mutated)
    env: dict[str, str] | None = None,
    num_schedulers: int = 1,
    per_worker_args: list[list[str]] = (),  # type: ignore[assignment]
    per_worker_env: list[dict[str, str]] = (),  # type: ignore[assignment]
    token: str = "",
) -> FleetStack:
    """Scheduler(s) first (workers register with them), then the workers (worker i with
    `per_worker_args[i]` too and `per_worker_env[i]` in its environment, where given), then the
    gateway. With one scheduler, the workers and
    the gateway start together (the gateway follows the scheduler's readiness), then each is
    waited for; with several (shards), workers start one by one, each joining the shard with
    the fewest workers. With a `token`, every service requires it (and sends it) on the
    internal hops."""
    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if token:
        base_env["LLMSERVE_INTERNAL_TOKEN"] = token
    gw_port, http_port = free_ports(2)
    stack = FleetStack(model, log_dir, list(scheduler_args), base_env, list(worker_args))
    stack.token = token
    stack.http_port = http_port
    for index in range(num_schedulers):
        sched_port, sched_metrics = free_ports(2)
        name = "scheduler" if num_schedulers == 1 else f"scheduler-{index}"
        stack.schedulers.append(
            Proc(
                name,
                [
                    "scheduler",
                    "--port",
                    str(sched_port),
                    "--metrics-port",
                    str(sched_metrics),
                    "--worker-lease-s",
                    "3",
                    "--health-interval-s",
                    "0.5",
                    *scheduler_args,
                ],
                f"127.0.0.1:{sched_port}",
                log_dir / f"{name}.log",
                base_env,
            )
        )
    stack.scheduler = stack.schedulers[0]
    try:
        for scheduler in stack.schedulers:
            scheduler.start(wait=False)
        if num_schedulers > 1:  # every shard answers before the first worker chooses one
            for scheduler in stack.schedulers:
                stack.wait_for(lambda _: True, f"{scheduler.name} up", scheduler=scheduler)
        together = num_schedulers == 1
        stack.gateway = Proc(
            "gateway",
            [
                "gateway",
                "--model",
                model,
                "--port",
                str(gw_port),
                "--http-port",
                str(http_port),
                "--scheduler",
                stack.scheduler_addresses,
            ],
            f"127.0.0.1:{gw_port}",
            log_dir / "gateway.log",
            base_env,
        )
        if together:
            stack.gateway.start(wait=False)
        for index in range(num_workers):
            stack.add_worker(
                wait=not together,
                args=per_worker_args[index] if index < len(per_worker_args) else [],
                env=per_worker_env[index] if index < len(per_worker_env) else None,
            )
        for worker in stack.workers if together else ():
            wait_healthy(worker.address, worker.popen, worker.name, worker.log)  # type: ignore[arg-type]

        def all_ready(_: scheduler_pb2.GetStatsResponse) -> bool:
            return sum(len(stack.ready_replicas(stack.stats(s))) for s in stack.schedulers) == (
                num_workers
            )

        stack.wait_for(all_ready, "workers ready")
        for scheduler in stack.schedulers:
            wait_healthy(
                scheduler.address,
                scheduler.popen,
                scheduler.name,  # type: ignore[arg-type]
                scheduler.log,
            )
        if together:
            wait_healthy(
                stack.gateway.address,
                stack.gateway.popen,
                "gateway",  # type: ignore[arg-type]
                stack.gateway.log,
            )
        else:
            stack.gateway.start()
    except BaseException:
        stack.stop()
        raise
    return stack


def spare_worker(
    stack: FleetStack, name: str, env: dict[str, str] | None = None, args: list[str] = ()
) -> Proc:  # type: ignore[assignment]
    """A worker of the stack's model that joins no scheduler by itself (`Lease` registers
    it), with `args` after the stack's worker args."""
    port, metrics_port = free_ports(2)
    proc = Proc(
        name,
        ["worker", "--model", stack.model, "--port", str(port),
         "--metrics-port", str(metrics_port), *stack.worker_args, *args],
        f"127.0.0.1:{port}",
        stack.log_dir / f"{name}.log",
        {**stack.env, **(env or {})},
    )  # fmt: skip
    stack.workers.append(proc)
    proc.start()
    return proc


class Lease:
    """Registers a worker with the scheduler and renews its lease each second, as a worker's
    own membership loop would, until closed."""

    def __init__(self, stack: FleetStack, address: str) -> None:
        assert stack.scheduler is not None
        self._channel = grpc.insecure_channel(stack.scheduler.address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._request = scheduler_pb2.RegisterWorkerRequest(address=address)
        self._metadata = stack.metadata
        self._stop = threading.Event()
        self._stub.RegisterWorker(self._request, timeout=5, metadata=self._metadata)
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(grpc.RpcError):  # drained or gone: the test decides
                self._stub.RegisterWorker(self._request, timeout=5, metadata=self._metadata)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


# -- the workload ------------------------------------------------------------------------------


@dataclass
class Received:
    """One request as its client saw it: per choice, the token ids and logprobs in order."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finish_reasons: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        """Record one streamed response."""
        for choice in response.choices:
            self.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
            self.logprobs.setdefault(choice.index, []).extend(
                lp.token.logprob for lp in choice.logprobs
            )
            if choice.finish_reason:
                self.finish_reasons[choice.index] = choice.finish_reason
        if response.HasField("usage"):
            self.completion_tokens = response.usage.completion_tokens

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids.values())


def mixed_workload(count: int, seed: int = 0) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """`count` requests: greedy, seeded sampling, n=2, best_of=3, one beam search; some with
    logprobs. Prompts are token ids, several sharing a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 20000) for _ in range(32)]
    requests: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    for i in range(count):
        prefix = shared[: rng.choice((0, 16, 32))]
        prompt = prefix + [rng.randrange(100, 20000) for _ in range(rng.randrange(4, 24))]
        kind = i % 6
        params: dict = {"max_tokens": rng.randrange(12, 32), "ignore_eos": True}  # type: ignore[type-arg]
        if kind in (0, 1):
            params["temperature"] = 0.0
        elif kind == 2:
            params.update(temperature=0.8, seed=1000 + i)
        elif kind == 3:
            params.update(temperature=0.9, seed=2000 + i, n=2)
        elif kind == 4:
            params.update(temperature=0.7, seed=3000 + i, best_of=3)
        else:
            params.update(temperature=0.6, seed=4000 + i, top_k=50)
        if i == 5:
            params = {
                "max_tokens": 16,
                "ignore_eos": True,
                "temperature": 0.0,
                "use_beam_search": True,
                "best_of": 2,
            }
        if i % 4 == 1:
            params["logprobs"] = 2
        requests.append((f"req-{i}", {"prompt": prompt, **params}))
    return requests


async def run_workload(
    gateway: str,
    requests: list[tuple[str, dict]],  # type: ignore[type-arg]
    on_chunk: Callable[[int], None] | None = None,
) -> dict[str, Received]:
    """Stream every request at once through the gateway's gRPC API; `on_chunk(total)` after
    each response received, `total` the tokens received so far (the test's trigger for a
    fault: tokens, not responses, as the gateway folds what a slow client has not read yet
    into one response)."""
    received: dict[str, Received] = {}
    total = 0
    async with grpc.aio.insecure_channel(gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(request_id: str, spec: dict) -> None:  # type: ignore[type-arg]
            nonlocal total
            spec = dict(spec)
            prompt = spec.pop("prompt")
            got = received[request_id] = Received()
            call = stub.Generate(build_request(prompt, request_id=request_id, **spec), timeout=300)
            async for response in call:
                got.add(response)
                total += sum(len(choice.token_ids) for choice in response.choices)
                if on_chunk is not None:
                    on_chunk(total)

        await asyncio.gather(*(one(rid, spec) for rid, spec in requests))
    return received


def assert_same_outputs(expected: dict[str, Received], actual: dict[str, Received]) -> None:
    """Token ids equal exactly; logprobs to 1e-3 (a continuation is recomputed by a prefill on
    another worker, whose float sums are ordered differently from the decode steps')."""
    assert expected.keys() == actual.keys()
    for request_id, want in expected.items():
        got = actual[request_id]
        assert got.token_ids == want.token_ids, request_id
        assert got.finish_reasons == want.finish_reasons, request_id
        assert got.completion_tokens == want.completion_tokens, request_id
        for index, logprobs in want.logprobs.items():
            assert len(got.logprobs[index]) == len(logprobs), request_id
            for a, b in zip(got.logprobs[index], logprobs, strict=True):
                assert abs(a - b) < 1e-3, (request_id, index, a, b)
