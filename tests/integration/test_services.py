"""Worker, scheduler and gateway as three real processes on loopback (issue 4's contract)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.client import AsyncClient, Client, build_request
from llmserve.ports import free_ports
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.offline import generate
from tests.support.stack import RunningStack, start_stack, wait_healthy
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

pytestmark = [pytest.mark.e2e, pytest.mark.services]

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Rain in Spain",
    "1, 2, 3, 4,",
    "Tea or coffee? I prefer",
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("stack-logs"),
        scheduler_args=["--max-num-seqs", "64"],
        gateway_args=["--max-message-bytes", str(256 * 1024)],
    )
    yield running
    running.stop()


def first_replica(scheduler: str) -> scheduler_pb2.ReplicaStats:
    with grpc.insecure_channel(scheduler) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )
    return reply.replicas[0]


def gpu_blocks(stack: RunningStack) -> tuple[int, int]:
    replica = first_replica(stack.scheduler)
    return replica.gpu_blocks_free, replica.gpu_blocks_total


def wait_all_blocks_free(stack: RunningStack, timeout_s: float = 30.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    free, total = gpu_blocks(stack)
    while free != total and time.monotonic() < deadline:
        time.sleep(0.2)
        free, total = gpu_blocks(stack)
    return free, total


def test_health_watch_streams_the_serving_status(stack: RunningStack):
    # Watch is a streaming handler written as a coroutine (context.write); the error
    # interceptor once assumed every streaming handler was an async generator.
    for address in (stack.worker, stack.scheduler, stack.gateway):
        with grpc.insecure_channel(address) as channel:
            updates = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            first = next(updates)
            updates.cancel()
        assert first.status == health_pb2.HealthCheckResponse.SERVING, address


def test_worker_service_runs_the_model_on_the_thread_that_built_it(stack: RunningStack):
    # Construction, loading, cache set-up and steps all on one thread: on CPU a second
    # OpenMP team made every decode step ~20% slower (see worker_service.worker.Worker).
    with Client(stack.gateway) as client:
        assert len(client.complete("Hello", max_tokens=4, ignore_eos=True).token_ids[0]) == 4
    log = stack.logs("worker")
    assert '"event": "model loaded"' in log
    assert "thread other than the one that constructed it" not in log


def test_greedy_outputs_equal_the_in_process_engine(stack: RunningStack, tiny_model_dir: Path):
    with Client(stack.gateway) as client:
        prompt_ids = [client.tokenize(p) for p in PROMPTS]
        served = [
            client.complete(ids, temperature=0.0, max_tokens=24, ignore_eos=True).token_ids[0]
            for ids in prompt_ids
        ]

    worker = Worker(WorkerConfig(model=str(tiny_model_dir), num_threads=1))
    worker.load_model()
    worker.initialize_cache(256, 0)
    engine = LLMEngine(
        SchedulerConfig(max_model_len=512),
        CacheConfig(num_gpu_blocks=256, num_cpu_blocks=0),
        worker,
    )
    local = generate(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    assert served == [out.outputs[0].token_ids for out in local]
    assert all(len(ids) == 24 for ids in served)


def runs_ended(stack: RunningStack) -> float:
    """The worker's llmserve_worker_multi_step_runs_ended_total."""
    port = stack.metrics_ports["worker"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    (value,) = re.findall(r"^llmserve_worker_multi_step_runs_ended_total (\S+)$", text, re.M)
    return float(value)


def test_requests_arriving_mid_run_end_its_passes_and_change_no_token(stack: RunningStack):
    # One stream decodes in multi-step runs (the default); short requests arrive one after
    # another while it does. Each arrival ends the runs in flight early, so that its first
    # token need not wait for their passes; every stream's tokens stay those it gets alone.
    long_prompt, short_prompts = PROMPTS[0], PROMPTS[1:]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    async def run() -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
        async with AsyncClient(stack.gateway, timeout_s=120) as client:
            alone = (await client.complete(long_prompt, max_tokens=200, **greedy)).token_ids[0]
            short_alone = [
                (await client.complete(p, max_tokens=4, **greedy)).token_ids[0]
                for p in short_prompts
            ]
            started, done = asyncio.Event(), asyncio.Event()

            async def long() -> list[int]:
                tokens: list[int] = []
                async for chunk in client.generate(long_prompt, max_tokens=200, **greedy):
                    tokens.extend(chunk.token_ids)
                    started.set()
                done.set()
                return tokens

            async def arrivals() -> list[list[int]]:
                await started.wait()
                got = []
                for p in short_prompts:  # one at a time, each while the long one decodes
                    got.append((await client.complete(p, max_tokens=4, **greedy)).token_ids[0])
                assert not done.is_set(), "the long stream ended before the arrivals"
                return got

            mixed, short_mixed = await asyncio.gather(long(), arrivals())
        return alone, mixed, short_alone, short_mixed

    before = runs_ended(stack)
    alone, mixed, short_alone, short_mixed = asyncio.run(run())
    assert mixed == alone and len(alone) == 200
    assert short_mixed == short_alone
    assert runs_ended(stack) > before
    wait_all_blocks_free(stack)


def test_64_concurrent_streams_with_mixed_n_max_tokens_and_stops(stack: RunningStack):
    async def one(client: AsyncClient, i: int) -> tuple[int, dict[int, str], dict[int, str | None]]:
        n = (1, 2, 3)[i % 3]
        max_tokens = 4 + i % 13
        stop = ["e"] if i % 4 == 0 else []
        texts: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        async for chunk in client.generate(
            PROMPTS[i % len(PROMPTS)],
            n=n,
            temperature=0.8,
            seed=i,
            max_tokens=max_tokens,
            stop=stop,
        ):
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
            if chunk.finish_reason:
                finish[chunk.index] = chunk.finish_reason
        return n, texts, finish

    async def run() -> list[tuple[int, dict[int, str], dict[int, str | None]]]:
        async with AsyncClient(stack.gateway, timeout_s=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    for i, (n, texts, finish) in enumerate(results):
        assert sorted(finish) == list(range(n)), f"request {i} left a choice unfinished"
        assert set(finish.values()) <= {"stop", "length"}
        if i % 4 == 0:
            assert all("e" not in t for t in texts.values())
    assert wait_all_blocks_free(stack)[0] == gpu_blocks(stack)[1]


def test_cancelled_stream_frees_its_blocks(stack: RunningStack):
    free_before, total = wait_all_blocks_free(stack)
    assert free_before == total
    request = build_request("A long story:", temperature=0.0, max_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(stack.gateway) as channel:
        from llmserve.v1 import generation_pb2_grpc

        call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
        for received, _ in enumerate(call, start=1):
            if received == 5:
                break
        busy, _ = gpu_blocks(stack)
        call.cancel()
    assert busy < total  # the request held blocks while it ran
    assert wait_all_blocks_free(stack) == (total, total)


@pytest.mark.parametrize(
    ("kwargs", "code", "field"),
    [
        (
            {"prompt": "hi", "temperature": -1.0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling_params.temperature",
        ),
        ({"prompt": "hi", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
        (
            {"prompt": "hi", "n": 2, "temperature": 0.0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling_params.best_of",
        ),
        (
            {"prompt": "hi", "max_tokens": 5000},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling_params.max_tokens",
        ),
        ({"prompt": "x " * 600}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
        ({"prompt": [10**7]}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids.ids"),
        ({"prompt": "hi", "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
    ],
)
def test_bad_requests_get_clear_codes(stack: RunningStack, kwargs, code, field):
    sampling = {k: v for k, v in kwargs.items() if k not in ("prompt", "model")}
    try:
        request = build_request(kwargs["prompt"], model=kwargs.get("model", ""), **sampling)
    except ValueError:
        # Our own client validates too; build the raw proto to reach the server.
        request = build_request(kwargs["prompt"], model=kwargs.get("model", ""))
        for name, value in sampling.items():
            setattr(request.sampling_params, name, value)
    with Client(stack.gateway) as client, pytest.raises(grpc.RpcError) as info:
        list(client.stream(request))
    assert info.value.code() == code
    assert info.value.details().startswith(f"{field}:")


def test_empty_prompt_and_missing_prompt_are_invalid(stack: RunningStack):
    with Client(stack.gateway) as client:
        for request in (generation_pb2.GenerateRequest(text=""), generation_pb2.GenerateRequest()):
            with pytest.raises(grpc.RpcError) as info:
                list(client.stream(request))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_message_is_rejected_and_others_unaffected(stack: RunningStack):
    huge = build_request("y" * (300 * 1024), max_tokens=1)
    with Client(stack.gateway) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.stream(huge))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = client.complete("still fine", temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(ok.token_ids[0]) == 3


def test_list_models_and_tokenize(stack: RunningStack, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with Client(stack.gateway) as client:
        assert client.tokenize("Hello world") == tokenizer.encode("Hello world")


def test_scheduler_waits_for_a_late_worker(tiny_model_dir: Path, tmp_path: Path):
    worker_port, scheduler_port = free_ports(2)
    scheduler_log = tmp_path / "scheduler.log"
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "scheduler",
            "--port",
            str(scheduler_port),
            "--workers",
            f"127.0.0.1:{worker_port}",
        ],
        stdout=scheduler_log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    worker = None
    scheduler_address = f"127.0.0.1:{scheduler_port}"
    try:
        # Not wait_healthy: the scheduler is NOT_SERVING until a worker is ready.
        deadline = time.monotonic() + 60
        while "worker not reachable, retrying" not in scheduler_log.read_text():
            assert scheduler.poll() is None, scheduler_log.read_text()
            assert time.monotonic() < deadline, scheduler_log.read_text()
            time.sleep(0.2)
        # Up, but with no ready worker it cannot serve, and its health says so.
        with grpc.insecure_channel(scheduler_address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        worker_log = tmp_path / "worker.log"
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "worker",
                "--model",
                str(tiny_model_dir),
                "--port",
                str(worker_port),
                "--kv-cache-memory",
                "0.01",
                "--swap-space",
                "0.01",
            ],
            stdout=worker_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_healthy(f"127.0.0.1:{worker_port}", worker, "worker", worker_log)
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 60
            while not stub.GetStats(scheduler_pb2.GetStatsRequest()).replicas[0].healthy:
                assert time.monotonic() < deadline, scheduler_log.read_text()
                time.sleep(0.3)
        # With a ready worker, the scheduler reports SERVING; SIGTERM turns it NOT_SERVING
        # before the server goes away (probes see the drain, not just a refused connection).
        wait_healthy(scheduler_address, scheduler, "scheduler", scheduler_log, timeout_s=30)
        with grpc.insecure_channel(scheduler_address) as channel:
            updates = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert next(updates).status == health_pb2.HealthCheckResponse.SERVING
            scheduler.terminate()
            assert next(updates).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        for proc in (worker, scheduler):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=15)


def test_worker_lost_with_no_other_fails_unavailable_after_the_wait(
    tiny_model_dir: Path, tmp_path: Path
):
    """A lost worker's requests wait for another replica (`--no-worker-timeout-s`), then fail
    UNAVAILABLE with a message that says so."""
    running = start_stack(
        str(tiny_model_dir), tmp_path, scheduler_args=["--no-worker-timeout-s", "2"]
    )
    try:
        with Client(running.gateway, timeout_s=60) as client:
            request = build_request(
                "Never ending", temperature=0.0, max_tokens=400, ignore_eos=True
            )
            stream = client.stream(request)
            next(stream)
            running.procs["worker"].kill()
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker became available within 2 s" in info.value.details()
    finally:
        running.stop()


def _wait_replica_healthy(scheduler: str, healthy: bool, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while first_replica(scheduler).healthy != healthy:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_idle_scheduler_notices_a_lost_worker_and_takes_a_restarted_one(
    tiny_model_dir: Path, tmp_path: Path
):
    # The Execute stream breaks while no request runs: the scheduler must notice then, not
    # fail the next request, and reconnect once a worker listens at the address again.
    running = start_stack(str(tiny_model_dir), tmp_path)
    try:
        with Client(running.gateway, timeout_s=60) as client:
            assert len(client.complete("Hello", max_tokens=3, ignore_eos=True).token_ids[0]) == 3
        worker = running.procs["worker"]
        worker.kill()
        worker.wait(timeout=15)
        assert _wait_replica_healthy(running.scheduler, False, timeout_s=10), (
            "the idle scheduler did not notice that its worker went away"
        )
        log = tmp_path / "worker-restarted.log"
        running.procs["worker"] = subprocess.Popen(
            worker.args, stdout=log.open("wb"), stderr=subprocess.STDOUT
        )
        wait_healthy(running.worker, running.procs["worker"], "worker", log)
        assert _wait_replica_healthy(running.scheduler, True, timeout_s=30), running.logs(
            "scheduler"
        )
        with Client(running.gateway, timeout_s=60) as client:
            assert len(client.complete("Hello", max_tokens=3, ignore_eos=True).token_ids[0]) == 3
        free, total = wait_all_blocks_free(running)
        assert free == total
    finally:
        running.stop()


def test_worker_joins_by_registering(tiny_model_dir: Path, tmp_path: Path):
    worker_port, scheduler_port = free_ports(2)
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "scheduler")}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "worker",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(worker_port),
            "--kv-cache-memory",
            "0.01",
            "--swap-space",
            "0.01",
            "--scheduler",
            f"127.0.0.1:{scheduler_port}",
        ],
        stdout=logs["worker"].open("wb"),
        stderr=subprocess.STDOUT,
    )
    scheduler = None
    try:
        wait_healthy(f"127.0.0.1:{worker_port}", worker, "worker", logs["worker"])
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", "scheduler", "--port", str(scheduler_port)],
            stdout=logs["scheduler"].open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_healthy(f"127.0.0.1:{scheduler_port}", scheduler, "scheduler", logs["scheduler"])
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 60
            while True:
                replicas = stub.GetStats(scheduler_pb2.GetStatsRequest()).replicas
                if replicas and replicas[0].healthy:
                    break
                assert time.monotonic() < deadline, logs["scheduler"].read_text()
                time.sleep(0.3)
        assert [r.address for r in replicas] == [f"127.0.0.1:{worker_port}"]
    finally:
        for proc in (scheduler, worker):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=15)


def test_swap_preemption_on_a_tiny_cache_completes(tiny_model_dir: Path, tmp_path: Path):
    # Two identical prompts on 4 blocks of 4 tokens: one request is swapped out and must come
    # back after the other finishes, even when a scheduling round in between runs nothing.
    running = start_stack(
        # 4 blocks hold one sequence of 16 tokens, no more (a longer max_model_len is refused).
        str(tiny_model_dir),
        tmp_path,
        worker_args=["--block-size", "4", "--max-model-len", "16"],
        # One token a step: multi-step decoding finishes the first request before the
        # second needs its blocks.
        scheduler_args=[
            "--num-gpu-blocks-override",
            "4",
            "--preemption-mode",
            "swap",
            "--decode-steps",
            "1",
        ],
    )
    try:

        async def run() -> list[list[int]]:
            async with AsyncClient(running.gateway, timeout_s=60) as client:
                done = await asyncio.gather(
                    *(
                        client.complete(
                            [5, 6, 7, 8, 9], temperature=0.0, max_tokens=8, ignore_eos=True
                        )
                        for _ in range(2)
                    )
                )
            return [d.token_ids[0] for d in done]

        first, second = asyncio.run(run())
        assert len(first) == 8 and first == second
        with grpc.insecure_channel(running.scheduler) as channel:
            stats = (
                scheduler_pb2_grpc.SchedulerStub(channel)
                .GetStats(scheduler_pb2.GetStatsRequest())
                .replicas[0]
            )
        assert stats.num_preemptions >= 1
        assert stats.gpu_blocks_free == stats.gpu_blocks_total
    finally:
        running.stop()


def test_a_high_priority_request_preempts_a_running_one_through_the_services(
    tiny_model_dir: Path, tmp_path: Path
):
    # One sequence at a time: a priority-0 request that arrives while a priority-5 one runs
    # takes its place, finishes first, and the preempted one still completes as it would have.
    running = start_stack(str(tiny_model_dir), tmp_path, scheduler_args=["--max-num-seqs", "1"])
    low_prompt, high_prompt = [5, 6, 7, 8, 9], [10, 11, 12]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    try:

        async def run() -> tuple[list[int], list[int], list[int], list[str]]:
            async with AsyncClient(running.gateway, timeout_s=120) as client:
                alone = await client.complete(low_prompt, max_tokens=64, **greedy)
                order: list[str] = []
                started = asyncio.Event()

                async def low() -> list[int]:
                    tokens: list[int] = []
                    async for chunk in client.generate(
                        low_prompt, max_tokens=64, priority=5, **greedy
                    ):
                        tokens.extend(chunk.token_ids)
                        started.set()
                    order.append("low")
                    return tokens

                async def high() -> list[int]:
                    await started.wait()
                    done = await client.complete(high_prompt, max_tokens=4, priority=0, **greedy)
                    order.append("high")
                    return done.token_ids[0]

                low_tokens, high_tokens = await asyncio.gather(low(), high())
            return alone.token_ids[0], low_tokens, high_tokens, order

        alone, low_tokens, high_tokens, order = asyncio.run(run())
        assert order == ["high", "low"]
        assert low_tokens == alone and len(high_tokens) == 4
        stats = first_replica(running.scheduler)
        assert stats.num_preemptions >= 1
        assert wait_all_blocks_free(running) == (stats.gpu_blocks_total, stats.gpu_blocks_total)
    finally:
        running.stop()


def test_gateway_readiness_is_one_state_over_grpc_and_http(
    stack: RunningStack, tiny_model_dir: Path, tmp_path: Path
):
    """A second gateway on the running scheduler, both ports polled from its first moment:
    `/ready` never says ok while gRPC health refuses, times out or says NOT_SERVING."""
    import httpx

    grpc_port, http_port = free_ports(2)
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "gateway",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--scheduler",
            stack.scheduler,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    samples: list[tuple[bool, str]] = []  # (/ready ok, gRPC health right after it)
    try:
        with httpx.Client() as http:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    http_ok = http.get(f"http://127.0.0.1:{http_port}/ready", timeout=1)
                    ready = http_ok.status_code == 200
                except httpx.HTTPError:
                    ready = False
                # A new connection per check, as a probe makes: a long-lived channel whose
                # first connect was refused backs off for seconds and answers UNAVAILABLE
                # meanwhile without trying (that was the "gRPC answers 4 s after /ready").
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    try:
                        reply = health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=1
                        )
                        grpc_state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    except grpc.RpcError as exc:
                        grpc_state = exc.code().name
                samples.append((ready, grpc_state))
                if ready and sum(r for r, _ in samples) >= 5:
                    break
                time.sleep(0.02)
    finally:
        stop_process_quietly(proc)
    assert any(ready for ready, _ in samples), (samples[-5:], log.read_text()[-2000:])
    assert not samples[0][0], "ready at the first poll: the start was not observed"
    mismatched = [s for s in samples if s[0] and s[1] != "SERVING"]
    assert mismatched == [], mismatched


def stop_process_quietly(proc: subprocess.Popen[bytes]) -> None:
    from llmserve.supervisor import stop_process

    stop_process(proc, grace_s=15)
