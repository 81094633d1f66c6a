"""docker-compose.yml for real, under podman (`make test-deploy`): the image built on a base
from Debian's packages, the stack up, requests over HTTP and gRPC, two workers both serving,
traces at the collector standing in for Jaeger, every Prometheus target up, two scheduler
shards (docker-compose.shards.yml) both serving, a prefill and a decode worker
(docker-compose.disagg.yml) serving, and `down` leaving nothing behind. The tests run in file
order against one stack."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from llmserve.client import Client
from llmserve.ports import free_ports
from tests.deploy.manifests import load_compose
from tests.deploy.podman import (
    BASE_IMAGE,
    ComposeProject,
    build_stand_ins,
    ensure_base_image,
    ensure_wheelhouse,
    get_json,
    image_id,
    podman,
    podman_volumes,
    post_json,
    remove_replaced_image,
    wait_until,
)

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(2400)]

IMAGE = "localhost/llmserve:deploy-test"
STARTUP_S = 600


@dataclass
class Stack:
    project: ComposeProject
    http: str
    grpc: str
    prometheus: str

    def prometheus_query(self, query: str) -> list[dict]:
        url = f"{self.prometheus}/api/v1/query?query={urllib.parse.quote(query)}"
        return get_json(url)["data"]["result"]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    services = load_compose("docker-compose.yml")["services"]
    ensure_base_image()
    ensure_wheelhouse()
    build_stand_ins(services["jaeger"]["image"], services["prometheus"]["image"])
    http, grpc_port, prometheus, jaeger_ui = free_ports(4)
    project = ComposeProject(
        f"llmserve-deploy-test-{os.getpid()}",
        {
            "BASE_IMAGE": BASE_IMAGE,
            "LLMSERVE_IMAGE": IMAGE,
            "PUBLISH_HOST": "127.0.0.1",
            "LLMSERVE_HTTP_PUBLISH": str(http),
            "LLMSERVE_GRPC_PUBLISH": str(grpc_port),
            "PROMETHEUS_PUBLISH": str(prometheus),
            "JAEGER_UI_PUBLISH": str(jaeger_ui),
            # Small KV caches: two workers and the rest share this machine's memory. Each must
            # still hold one 8192-token SmolLM2 sequence in float32 (0.35 GiB), or the worker
            # refuses it at start-up.
            "LLMSERVE_KV_CACHE_MEMORY": "0.375",
            "LLMSERVE_SWAP_SPACE": "0.25",
        },
    )
    # One build, through compose (BASE_IMAGE from the environment); the other services use
    # the same image tag.
    previous_image = image_id(IMAGE)
    project.compose("build", "gateway", timeout=1800)
    remove_replaced_image(IMAGE, previous_image)
    project.volumes_before = set(podman_volumes())
    try:
        project.compose("up", "-d")
        yield Stack(
            project,
            f"http://127.0.0.1:{http}",
            f"127.0.0.1:{grpc_port}",
            f"http://127.0.0.1:{prometheus}",
        )
    finally:
        if project.containers():
            for service in ("worker", "worker-prefill", "scheduler", "scheduler-b", "gateway"):
                print(f"--- {service} ---\n{project.logs(service)[-4000:]}")
        project.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300)


def test_ready_once_a_worker_is_ready(stack: Stack):
    def ready() -> bool:
        return get_json(stack.http + "/ready") == {"status": "ok"}

    wait_until(ready, STARTUP_S, "gateway /ready")
    assert get_json(stack.http + "/health") == {"status": "ok"}


def test_chat_completion_over_http(stack: Stack):
    reply = post_json(
        stack.http + "/v1/chat/completions",
        {
            "model": "smollm2",
            "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colors."}],
        },
    )
    assert reply["object"] == "chat.completion"
    assert "red" in reply["choices"][0]["message"]["content"].lower()  # case moves with roundings
    assert reply["usage"]["completion_tokens"] > 0


def test_generate_over_grpc(stack: Stack):
    with Client(stack.grpc, timeout_s=120) as client:
        completion = client.complete(
            "The three primary colors are", max_tokens=8, temperature=0.0, ignore_eos=True
        )
    assert completion.completion_tokens == 8
    assert completion.text.strip()


def greedy_completion(stack: Stack, prompt: str, max_tokens: int) -> int:
    """A greedy /v1/completions of exactly `max_tokens`; the completion tokens it reports."""
    reply = post_json(
        stack.http + "/v1/completions",
        {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    return int(reply["usage"]["completion_tokens"])


def test_two_workers_both_serve(stack: Stack):
    stack.project.compose("up", "-d", "--scale", "worker=2")
    assert len(stack.project.container_of("worker")) == 2

    def two_ready() -> bool:
        ready = stack.prometheus_query('llmserve_workers{state="ready"}')
        return bool(ready) and float(ready[0]["value"][1]) == 2

    wait_until(two_ready, STARTUP_S, "the scheduler has two ready workers")

    def steps_by_worker() -> dict[str, float]:
        return {
            sample["metric"]["instance"]: float(sample["value"][1])
            for sample in stack.prometheus_query("llmserve_worker_steps_total")
        }

    before = steps_by_worker()

    def complete(i: int) -> int:
        return greedy_completion(stack, f"Request {i}: count from {i} to {i + 20}:", 24)

    def both_stepped() -> bool:
        # Concurrent requests: the router weighs load, so each worker takes some.
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, range(8))) == [24] * 8
        after = wait_until(
            lambda: len(steps_by_worker()) == 2 and steps_by_worker(), 30, "both workers scraped"
        )
        return all(after[w] > before.get(w, 0.0) for w in after)

    assert wait_until(both_stepped, 300, "steps on both workers", interval_s=0)


def test_traces_reach_the_collector(stack: Stack):
    def services_seen() -> set[str]:
        log = stack.project.logs("jaeger")
        names = {"llmserve-gateway", "llmserve-scheduler", "llmserve-worker"}
        return {name for name in names if f"service.name: Str({name})" in log}

    seen = wait_until(
        lambda: len(services_seen()) == 3 and services_seen(),
        60,
        "spans of every service at the collector",
    )
    assert seen == {"llmserve-gateway", "llmserve-scheduler", "llmserve-worker"}
    assert "Name           : scheduler.request" in stack.project.logs("jaeger")


def test_every_prometheus_target_is_up(stack: Stack):
    def targets() -> list[dict]:
        active = get_json(stack.prometheus + "/api/v1/targets")["data"]["activeTargets"]
        return active if all(t["health"] == "up" for t in active) else []

    active = wait_until(targets, 60, "every target up")
    jobs = sorted(t["labels"]["job"] for t in active)
    assert jobs == ["llmserve-gateway", "llmserve-scheduler", "llmserve-worker", "llmserve-worker"]


def scheduler_metric(stack: Stack, service: str, name: str) -> float:
    """The sum of a scheduler's counter `name` over its labels, read inside its container."""
    [container] = stack.project.container_of(service)
    read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9102/metrics').read().decode())"
    text = podman("exec", container, "python", "-c", read).stdout
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def test_two_scheduler_shards_both_serve(stack: Stack):
    stack.project.extra_files.append("docker-compose.shards.yml")
    stack.project.compose("up", "-d", "--scale", "worker=2")
    shards = ("scheduler", "scheduler-b")

    def each_shard_has_a_worker() -> bool:  # a scheduler is SERVING with a ready worker
        for service in shards:
            [container] = stack.project.container_of(service)
            health = ("exec", container, "llmserve", "health", "127.0.0.1:50071")
            if podman(*health, check=False).returncode != 0:
                return False
        return True

    wait_until(each_shard_has_a_worker, STARTUP_S, "a ready worker on each shard")
    wait_until(lambda: get_json(stack.http + "/ready") == {"status": "ok"}, 120, "gateway /ready")
    finished = "llmserve_requests_finished_total"
    before = {s: scheduler_metric(stack, s, finished) for s in shards}

    def complete(i: int) -> int:
        return greedy_completion(stack, f"Shard request {i}: list {i} colours:", 12)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(complete, range(8))) == [12] * 8
    # The gateway placed requests on both shards (distinct prompts spread by prefix).
    after = {s: scheduler_metric(stack, s, finished) for s in shards}
    assert all(after[s] > before[s] for s in shards), (before, after)
    assert sum(after.values()) - sum(before.values()) == 8


def test_a_prefill_and_a_decode_worker_serve(stack: Stack):
    """docker-compose.disagg.yml instead of the shards' file: a long prompt prefills on the
    prefill worker and moves to the decode worker with its KV blocks."""
    # scheduler-b is not part of this stack: `up` would leave it running as an orphan.
    for container in stack.project.container_of("scheduler-b"):
        podman("rm", "-f", "-t", "10", container)
    stack.project.extra_files[:] = ["docker-compose.disagg.yml"]
    # podman-compose takes one --scale (the last) and recreates only the containers of the
    # scale it computes: without worker=2 here, worker_2 would go on with the shards' config.
    # worker-prefill gets its default one.
    stack.project.compose("up", "-d", "--scale", "worker=2")
    decode_workers = stack.project.container_of("worker")
    assert len(decode_workers) == 2
    assert len(stack.project.container_of("worker-prefill")) == 1
    for container in decode_workers:  # every decode worker runs this file's configuration
        assert "LLMSERVE_ROLE=decode" in stack.project.environment(container)

    def pools_ready() -> bool:
        ready = stack.prometheus_query('llmserve_workers{state="ready"}')
        return bool(ready) and float(ready[0]["value"][1]) == 3

    wait_until(
        pools_ready,
        STARTUP_S,
        "a ready prefill worker and two ready decode workers",
        explain=lambda: stack.project.describe("scheduler", "worker", "worker-prefill"),
    )
    wait_until(lambda: get_json(stack.http + "/ready") == {"status": "ok"}, 120, "gateway /ready")
    handed_off = 'llmserve_kv_migrations_total{outcome="transfer"}'
    before = scheduler_metric(stack, "scheduler", handed_off)
    prompt = " ".join(f"item {i}," for i in range(80))  # well over 128 tokens
    assert greedy_completion(stack, prompt, 16) == 16
    assert scheduler_metric(stack, "scheduler", handed_off) == before + 1


def test_down_leaves_nothing_running(stack: Stack):
    stack.project.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300)
    assert stack.project.containers() == []
    assert stack.project.volumes() == []
    # Nor an anonymous volume (an image's VOLUME line would leave one per container).
    assert set(podman_volumes()) <= stack.project.volumes_before
    assert stack.project.networks() == []
