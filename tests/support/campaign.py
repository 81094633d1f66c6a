"""A fault campaign: a stack of two scheduler shards, four workers and two gateways, a mixed
workload, and faults of every kind drawn from a seed, with every stream checked.

A round sends its workload twice: once undisturbed (the reference), then with the round's
faults, each fired when the clients have received a drawn number of responses. The seed
fixes the workloads and the fault schedule. tests/support/campaign_checks.py runs rounds and
checks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from llmserve.client import build_request
from llmserve.grammar.spec import GrammarSpec
from llmserve.grpc_utils import channel_options
from llmserve.ports import free_ports
from llmserve.v1 import generation_pb2_grpc
from scheduler_service.fleet.admission import RETRY_AFTER_S
from tests.support.fleet import FleetStack, Proc, Received, mixed_workload, start_fleet
from tests.support.grammar import BOUNDED_SCHEMA, WEATHER_TOOL

NUM_WORKERS = 2 * 2  # two per shard
NUM_SHARDS = 2
WORKLOAD_SIZE = 24
# Per shard: a burst of BURST_SIZE short requests overflows it, the round's workload does not.
MAX_WAITING = 40
BURST_SIZE = 2 * MAX_WAITING + 16
# How often a workload request refused under overload is sent again before that counts as a
# failure.
MAX_REFUSALS = 30
# What a refusal before the first token may be: a full queue (429) or no ready worker (503).
REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
# What gRPC says of a connection that broke or was refused (a gateway that is gone).
TRANSPORT = re.compile(r"failed to connect|Socket closed|Connection reset|Broken pipe|GOAWAY")
SCHEDULER_ARGS = [
    "--max-num-seqs", "16",
    "--max-waiting-requests", str(MAX_WAITING),
    "--num-speculative-tokens", "3",
]  # fmt: skip
# Small caches: the workload preempts (swap and recompute).
WORKER_ARGS = ["--kv-cache-memory", "0.01", "--swap-space", "0.01", "--num-threads", "1"]
# Failpoints armed on the first workers: the first kills itself serving its second KV export,
# the second importing its second; restarted, they run without.
WORKER_FAILPOINTS = ["worker.read_blocks=1+1", "worker.import_blocks=1+1"]

FAULT_KINDS = (
    "worker_kill",  # SIGKILL; the monitor starts it again on its ports
    "worker_pause",  # SIGSTOP for `duration_s`, then SIGCONT: a slow step, or a lost worker
    "worker_drain",  # SIGTERM: the worker drains itself and exits; a new worker joins
    "shard_kill",
    "shard_pause",
    "gateway_kill",  # the second gateway; its clients retry on the first
    "burst",  # BURST_SIZE short requests at once: a full waiting queue
)


@dataclass(frozen=True)
class Fault:
    at_response: int  # fired once the round's clients have received this many responses
    kind: str
    target: int  # index into the workers or the shards (kinds that need one)
    duration_s: float = 0.0


def draw_faults(rng: random.Random, count: int, responses: int) -> list[Fault]:
    """`count` faults at response counts spread over the first two thirds of a round."""
    faults = []
    for _ in range(count):
        kind = rng.choice(FAULT_KINDS)
        target = rng.randrange(NUM_SHARDS if kind.startswith("shard") else NUM_WORKERS)
        duration = rng.choice((0.3, 1.0, 6.0)) if kind.endswith("pause") else 0.0
        at = rng.randrange(responses // 10, max(responses // 10 + 1, 2 * responses // 3))
        faults.append(Fault(at, kind, target, duration))
    return sorted(faults, key=lambda f: f.at_response)


TOOL_SCHEMA = WEATHER_TOOL["function"]["parameters"]
# Long prompts share a prefix this long: more than a prefix fetch's minimum (64), so a worker
# lacking it may copy its KV blocks from one that holds it.
LONG_PREFIX_TOKENS = 192


def campaign_workload(seed: int, count: int = WORKLOAD_SIZE) -> list[tuple[str, dict[str, Any]]]:
    """The fleet tests' mixed workload (greedy, seeded, n=2, best_of, beam search, logprobs,
    shared prefixes) with, in place of some of it: a JSON schema and a tool-argument schema,
    text prompts with stop strings, long prompts sharing a long prefix; priorities; and
    streams their clients cancel."""
    rng = random.Random(seed)
    requests = mixed_workload(count, seed)
    long_prefix = [rng.randrange(100, 20000) for _ in range(LONG_PREFIX_TOKENS)]
    out = []
    for i, (request_id, spec) in enumerate(requests):
        spec = dict(spec)
        request_id = f"s{seed}-{request_id}"
        if i % 8 == 2:
            schema = BOUNDED_SCHEMA if rng.random() < 0.5 else TOOL_SCHEMA
            spec = {
                "prompt": spec["prompt"],
                "max_tokens": 160,
                "temperature": rng.choice((0.0, 1.0)),
                "seed": 6000 + i,
                "grammar": GrammarSpec.json_schema(schema, "response_format"),
            }
        elif i % 8 == 7:
            spec = {
                "prompt": f"Story {i}: once upon a time",
                "max_tokens": 24,
                "temperature": 0.8,
                "seed": 7000 + i,
                "stop": ["e ", "."],
            }
        elif i % 8 == 6:
            tail = [rng.randrange(100, 20000) for _ in range(rng.randrange(8, 24))]
            spec = {"prompt": long_prefix + tail, "max_tokens": 16, "ignore_eos": True,
                    "temperature": rng.choice((0.0, 0.7)), "seed": 8000 + i}  # fmt: skip
        spec["priority"] = rng.choice((-1, 0, 0, 1))
        if i % 8 == 4:
            spec["cancel_after"] = rng.randrange(2, 6)
        out.append((request_id, spec))
    return out


@dataclass
class Outcome:
    """One request as its client saw it."""

    received: Received = field(default_factory=Received)
    error: grpc.StatusCode | None = None
    error_details: str = ""
    gateway: int = 0
    cancelled: bool = False
    times: list[float] = field(default_factory=list)  # when each response arrived
    retries: int = 0  # starts again on the other gateway after its gateway was killed
    refusals: int = 0  # refused with RESOURCE_EXHAUSTED, then sent again
    lost_codes: list[grpc.StatusCode] = field(default_factory=list)  # from a killed gateway


@dataclass
class CampaignStack:
    fleet: FleetStack
    gateways: list[Proc]
    # Processes that exited on purpose (drained) and are not to be started again.
    retired: set[int] = field(default_factory=set)
    # For each gateway, how many times it was killed (a client error from a gateway killed
    # during its request is a retry, any other a failure).
    gateway_kills: list[int] = field(default_factory=lambda: [0, 0])
    _stop: threading.Event = field(default_factory=threading.Event)

    def processes(self) -> list[Proc]:
        return [*self.fleet.workers, *self.fleet.schedulers, *self.gateways]

    def monitor(self) -> threading.Thread:
        """Start again, on its ports, any process that died and was not retired: what
        `llmserve up` or a Deployment does."""

        def watch() -> None:
            while not self._stop.wait(0.25):
                for proc in self.processes():
                    if id(proc) in self.retired or proc.popen is None:
                        continue
                    if proc.popen.poll() is not None:
                        proc.env = {k: v for k, v in proc.env.items() if k != "LLMSERVE_FAILPOINTS"}
                        proc.start(wait=False)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        for proc in self.processes():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # a paused one must hear SIGTERM
        for gateway in self.gateways[1:]:
            gateway.stop()
        self.fleet.stop()


def start_campaign_stack(model: str, log_dir: Path) -> CampaignStack:
    fleet = start_fleet(
        model,
        log_dir,
        NUM_WORKERS,
        num_schedulers=NUM_SHARDS,
        scheduler_args=SCHEDULER_ARGS,
        worker_args=WORKER_ARGS,
        per_worker_env=[{"LLMSERVE_FAILPOINTS": f} for f in WORKER_FAILPOINTS],
    )
    assert fleet.gateway is not None
    port, http_port = free_ports(2)
    second = Proc(
        "gateway-1",
        ["gateway", "--model", model, "--port", str(port), "--http-port", str(http_port),
         "--scheduler", fleet.scheduler_addresses],
        f"127.0.0.1:{port}",
        log_dir / "gateway-1.log",
        fleet.env,
    )  # fmt: skip
    try:
        second.start()
    except BaseException:
        fleet.stop()
        raise
    stack = CampaignStack(fleet, [fleet.gateway, second])
    stack.monitor()
    return stack


class Round:
    """One workload through the stack's gateways (request i through gateway i % 2), with
    `faults` fired as responses arrive."""

    def __init__(
        self, stack: CampaignStack, workload: list[tuple[str, dict[str, Any]]], faults: list[Fault]
    ) -> None:
        self.stack = stack
        self.workload = workload
        self.faults = list(faults)
        self.outcomes: dict[str, Outcome] = {}
        self.bursts: dict[str, Outcome] = {}
        self._bursts = itertools.count()
        self.fired: list[tuple[Fault, float]] = []
        self.responses = 0
        self._stubs: list[generation_pb2_grpc.GenerationStub] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        channels = [
            grpc.aio.insecure_channel(g.address, options=channel_options())
            for g in self.stack.gateways
        ]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
        try:
            self._tasks = [
                asyncio.ensure_future(self._one(rid, spec, i % 2, self.outcomes))
                for i, (rid, spec) in enumerate(self.workload)
            ]
            while self._tasks:
                task = self._tasks.pop()
                await task
        finally:
            for channel in channels:
                await channel.close()

    def _on_response(self) -> None:
        self.responses += 1
        while self.faults and self.faults[0].at_response <= self.responses:
            fault = self.faults.pop(0)
            self.fired.append((fault, time.monotonic()))
            self._fire(fault)

    def _fire(self, fault: Fault) -> None:
        stack, fleet = self.stack, self.stack.fleet
        workers = [w for w in fleet.workers if id(w) not in stack.retired]
        if fault.kind == "worker_kill":
            _signal(workers[fault.target % len(workers)], signal.SIGKILL)
        elif fault.kind == "worker_pause":
            self._pause(workers[fault.target % len(workers)], fault.duration_s)
        elif fault.kind == "worker_drain":
            worker = workers[fault.target % len(workers)]
            stack.retired.add(id(worker))
            _signal(worker, signal.SIGTERM)
            fleet.add_worker(wait=False)
        elif fault.kind == "shard_kill":
            _signal(fleet.schedulers[fault.target], signal.SIGKILL)
        elif fault.kind == "shard_pause":
            self._pause(fleet.schedulers[fault.target], fault.duration_s)
        elif fault.kind == "gateway_kill":
            stack.gateway_kills[1] += 1
            _signal(stack.gateways[1], signal.SIGKILL)
        elif fault.kind == "burst":
            start = next(self._bursts) * BURST_SIZE
            for i in range(BURST_SIZE):
                spec = {"prompt": [100 + i, 200 + start, 300], "max_tokens": 4,
                        "ignore_eos": True, "temperature": 0.0}  # fmt: skip
                self._tasks.append(
                    asyncio.ensure_future(self._one(f"burst-{start + i}", spec, 0, self.bursts))
                )
        else:
            raise ValueError(f"unknown fault {fault.kind}")

    def _pause(self, proc: Proc, duration_s: float) -> None:
        """SIGSTOP the process, and SIGCONT that same process `duration_s` later, from a timer
        thread: the round may end first."""
        if proc.popen is None or proc.popen.poll() is not None:
            return
        pid = proc.popen.pid
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(duration_s, _resume, (pid,))
        timer.daemon = True
        timer.start()

    async def _one(
        self, request_id: str, spec: dict[str, Any], gateway: int, into: dict[str, Outcome]
    ) -> None:
        spec = dict(spec)
        prompt = spec.pop("prompt")
        cancel_after = spec.pop("cancel_after", None)
        outcome = into[request_id] = Outcome(gateway=gateway)
        while True:
            kills = self.stack.gateway_kills[outcome.gateway]
            got = outcome.received = Received()
            call = self._stubs[outcome.gateway].Generate(
                build_request(prompt, request_id=request_id, **spec), timeout=600
            )
            try:
                async for response in call:
                    got.add(response)
                    outcome.times.append(time.monotonic())
                    self._on_response()
                    if cancel_after is not None and got.num_tokens >= cancel_after:
                        outcome.cancelled = True
                        call.cancel()
                        return
                return
            except grpc.aio.AioRpcError as exc:
                # The connection broke (not an answer of the gateway's): the second gateway
                # was killed during the call, or is down since a kill. The client retries on
                # the first, as a client behind a load balancer would.
                code, details = exc.code(), exc.details() or ""
                broken = code == grpc.StatusCode.UNAVAILABLE and bool(TRANSPORT.search(details))
                lost = self.stack.gateway_kills[outcome.gateway] != kills or (broken and kills > 0)
                if lost and outcome.gateway == 1:
                    outcome.lost_codes.append(code)
                    outcome.retries += 1
                    outcome.gateway = 0
                    continue
                # Refused before its first token, under overload (429) or with no ready worker
                # anywhere (503): the client waits as told and sends it again.
                refused = code in REFUSALS and not broken and not got.num_tokens
                if refused and into is self.outcomes and outcome.refusals < MAX_REFUSALS:
                    outcome.refusals += 1
                    await asyncio.sleep(RETRY_AFTER_S)
                    continue
                outcome.error, outcome.error_details = exc.code(), exc.details() or ""
                return


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed while paused
        os.kill(pid, signal.SIGCONT)


def _signal(proc: Proc, sig: signal.Signals) -> None:
    if proc.popen is not None and proc.popen.poll() is None:
        os.kill(proc.popen.pid, sig)


def run_round(
    stack: CampaignStack, workload: list[tuple[str, dict[str, Any]]], faults: list[Fault]
) -> Round:
    round_ = Round(stack, workload, faults)
    asyncio.run(round_.run())
    return round_
