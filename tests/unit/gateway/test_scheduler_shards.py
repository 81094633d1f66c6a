"""SchedulerClient over several scheduler shards: placement by prefix and load, and a lost
shard's requests continuing on another, against fake schedulers served over real gRPC (the
fakes of tests/support/fake_connect.py: tokens are a formula of the prompt, the choice and the
position, so a continuation on another shard must give the uninterrupted stream)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from gateway.scheduler_client import SchedulerClient
from gateway.shard_routing import PREFIX_TOKENS, pick_shard, prefix_key
from llmserve.sampling_params import SamplingParams
from llmserve.service_main import shard_addresses
from tests.support.fake_connect import FakeServer, Received, consume, until

SHARDS = ["10.0.0.1:50071", "10.0.0.2:50071", "10.0.0.3:50071", "10.0.0.4:50071"]


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(rng.randrange(4, 90))] for _ in range(count)]


# -- placement -----------------------------------------------------------------------------------


def test_a_prompt_prefers_the_same_shard_whatever_follows_its_prefix():
    rng = random.Random(1)
    for prompt in prompts(50):
        longer = prompt + [rng.randrange(3, 30000) for _ in range(PREFIX_TOKENS)]
        idle = dict.fromkeys(SHARDS, 0)
        assert pick_shard(prefix_key(longer[:PREFIX_TOKENS] + [7]), idle) == pick_shard(
            prefix_key(longer[:PREFIX_TOKENS] + [8, 9]), idle
        )


def test_idle_shards_share_the_prefixes_about_evenly():
    counts = dict.fromkeys(SHARDS, 0)
    for prompt in prompts(2000):
        shard = pick_shard(prefix_key(prompt), dict.fromkeys(SHARDS, 0))
        assert shard is not None
        counts[shard] += 1
    assert all(400 <= count <= 600 for count in counts.values()), counts


def test_losing_a_shard_moves_only_the_prefixes_it_had():
    before = {}
    for i, prompt in enumerate(prompts(500)):
        before[i] = pick_shard(prefix_key(prompt), dict.fromkeys(SHARDS, 0))
    survivors = dict.fromkeys(SHARDS[1:], 0)
    for i, prompt in enumerate(prompts(500)):
        after = pick_shard(prefix_key(prompt), survivors)
        if before[i] != SHARDS[0]:
            assert after == before[i]
        else:
            assert after in survivors


def test_a_hot_prefix_spills_over_within_the_load_bound():
    hot = prefix_key(list(range(100, 100 + PREFIX_TOKENS)))
    loads = dict.fromkeys(SHARDS[:2], 0)
    for _ in range(40):
        shard = pick_shard(hot, loads)
        assert shard is not None
        loads[shard] += 1
    # Each may hold up to ceil(1.25 * mean): 25 of 40 at most, 15 at least.
    assert sorted(loads.values()) == [15, 25]
    assert pick_shard(hot, {}) is None


def test_scheduler_flag_names_distinct_shards():
    assert shard_addresses("a:1, b:2") == ["a:1", "b:2"]
    for bad in ("a:1,,b:2", "a:1,a:1", ""):
        try:
            shard_addresses(bad)
        except ValueError as exc:
            assert "--scheduler" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


# -- the client over two fake shards ---------------------------------------------------------------

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6),
    SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=7, logprobs=1),
    SamplingParams(n=1, best_of=2, temperature=0.7, seed=9, max_tokens=5),
]
REQUESTS = {f"r{i}": (prompt, PARAMS[i % 3]) for i, prompt in enumerate(prompts(12, seed=3))}


def run_shards(
    test: Callable[[list[FakeServer], SchedulerClient], Awaitable[None]], count: int = 2
) -> None:
    async def main() -> None:
        servers = [FakeServer() for _ in range(count)]
        for server in servers:
            await server.start()
        client = SchedulerClient([s.address for s in servers], 1 << 20, reconnect_timeout_s=30)
        client.start()
        try:
            await until(lambda: all(client.shard_connected(s.address) for s in servers), "up")
            await test(servers, client)
        finally:
            await client.close()
            for server in servers:
                await server.stop()

    asyncio.run(main())


async def submit_all(client: SchedulerClient) -> dict[str, Received]:
    got = {name: Received() for name in REQUESTS}
    for name, (prompt, params) in REQUESTS.items():
        asyncio.create_task(consume(client.submit(name, prompt, params, None), got[name]))
    return got


async def submit_to_both(
    servers: list[FakeServer], client: SchedulerClient
) -> tuple[dict[str, Received], set[str]]:
    """Every request submitted, and the ids the first of two shards took (some, not all)."""
    got = await submit_all(client)
    await until(lambda: sum(len(s.fake.adds) for s in servers) == len(REQUESTS), "all added")
    on_first = {a.request_id for a in servers[0].fake.adds}
    assert 0 < len(on_first) < len(REQUESTS), "both shards should take requests"
    return got, on_first


async def step_until_done(servers: list[FakeServer], got: dict[str, Received]) -> None:
    while not all(g.finished or g.error for g in got.values()):
        for server in servers:
            server.fake.step()
        await asyncio.sleep(0.01)


def reference() -> dict[str, Received]:
    result: dict[str, Received] = {}

    async def test(servers: list[FakeServer], client: SchedulerClient) -> None:
        got = await submit_all(client)
        await until(lambda: len(servers[0].fake.adds) == len(REQUESTS), "all added")
        await step_until_done(servers, got)
        result.update(got)

    run_shards(test, count=1)
    return result


def test_a_lost_shards_requests_continue_on_the_other_with_the_same_tokens():
    expected = reference()
    moved: dict[str, int] = {}

    async def test(servers: list[FakeServer], client: SchedulerClient) -> None:
        lost, survivor = servers
        got, on_lost = await submit_to_both(servers, client)
        for _ in range(2):
            for server in servers:
                server.fake.step()
            await asyncio.sleep(0.05)
        await lost.stop()  # never comes back
        await until(
            lambda: on_lost <= {a.request_id for a in survivor.fake.adds}, "moved to the survivor"
        )
        resent = {a.request_id: a for a in survivor.fake.adds if a.request_id in on_lost}
        moved.update({rid: len(add.continuation.choices) for rid, add in resent.items()})
        await step_until_done([survivor], got)
        assert [g.error for g in got.values()] == [None] * len(got)
        for name, g in got.items():
            assert g.tokens == expected[name].tokens, name
            assert g.logprobs == expected[name].logprobs, name
            assert g.finish == expected[name].finish, name
        assert client.shard_load(lost.address) == client.shard_load(survivor.address) == 0

    run_shards(test)
    # Streaming requests moved as continuations; best_of > n ones start over (no choices).
    for rid, choices in moved.items():
        assert choices == (
            0 if REQUESTS[rid][1].best_of > REQUESTS[rid][1].n else REQUESTS[rid][1].n
        )


def test_requests_go_to_serving_shards_and_prefixes_stay_together():
    async def test(servers: list[FakeServer], client: SchedulerClient) -> None:
        serving = servers[1].address
        client.is_serving = lambda address: address == serving
        got = await submit_all(client)
        await until(lambda: len(servers[1].fake.adds) == len(REQUESTS), "all on the serving one")
        assert servers[0].fake.adds == []
        await step_until_done(servers, got)

        client.is_serving = lambda address: True
        shared = list(range(1000, 1000 + PREFIX_TOKENS))
        for i in range(3):
            prompt, params = shared + [i + 5], SamplingParams(max_tokens=2)
            await consume_one(client, servers, f"shared-{i}", prompt, params)
        where = {s.address for s in servers for a in s.fake.adds if a.request_id.startswith("sh")}
        assert len(where) == 1

    run_shards(test)


async def consume_one(
    client: SchedulerClient,
    servers: list[FakeServer],
    name: str,
    prompt: list[int],
    params: SamplingParams,
) -> None:
    got = Received()
    task = asyncio.create_task(consume(client.submit(name, prompt, params, None), got))
    await step_until_done(servers, {name: got})
    await task
    assert got.finished and got.error is None


def test_requests_on_a_shard_left_without_workers_move_to_a_serving_one():
    """A shard whose workers all left (its health turns NOT_SERVING) keeps no request while
    another serves: each is aborted there and continues on the other with the same tokens
    (found by the fault campaign: they waited there for --no-worker-timeout-s, then failed)."""
    expected = reference()

    async def test(servers: list[FakeServer], client: SchedulerClient) -> None:
        idle, serving = servers
        got, on_idle = await submit_to_both(servers, client)
        for server in servers:
            server.fake.step()
        await asyncio.sleep(0.05)
        assert client.move_off_idle_shards() == 0  # every shard serves
        client.is_serving = lambda address: address == serving.address
        assert client.move_off_idle_shards() == len(on_idle)
        await until(lambda: set(idle.fake.aborts) == on_idle, "aborted on the idle shard")
        await until(
            lambda: on_idle <= {a.request_id for a in serving.fake.adds}, "moved to the other"
        )
        assert all(a.resubmitted for a in serving.fake.adds if a.request_id in on_idle)
        await step_until_done([serving], got)
        assert [g.error for g in got.values()] == [None] * len(got)
        for name, g in got.items():
            assert g.tokens == expected[name].tokens, name
            assert g.finish == expected[name].finish, name
        assert client.shard_load(idle.address) == 0

    run_shards(test)
