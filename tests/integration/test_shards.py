"""Scheduler shards with real processes: two schedulers, four workers that register with leases
(each joins the shard with the fewer workers), one gateway that knows both shards.

The stack serves greedy output equal to transformers'; SIGKILL of a shard under 16 streams
leaves every stream identical to an undisturbed run (the gateway re-submits the lost shard's
requests as continuations to the other), the survivor takes over the lost shard's workers, and
every block is free afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fleet import (
    FleetStack,
    Proc,
    Received,
    assert_same_outputs,
    mixed_workload,
    run_workload,
    start_fleet,
)
from tests.support.models import hf_greedy_outputs, load_hf

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

WORKLOAD = mixed_workload(16, seed=11)


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start_fleet(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("shard-logs"),
        4,
        num_schedulers=2,
        scheduler_args=["--max-num-seqs", "16"],
    )
    yield stack
    stack.stop()


def ready_on(stack: FleetStack, shard: Proc) -> int:
    return len(stack.ready_replicas(stack.stats(shard)))


def test_shards_split_the_workers_and_serve_hf_equal_greedy_output(
    shards: FleetStack, tiny_model_dir: Path
):
    assert [ready_on(shards, s) for s in shards.schedulers] == [2, 2]
    # Each names itself by host and port (--shard-name's default).
    names = [shards.stats(s).shard for s in shards.schedulers]
    assert [n.rsplit(":", 1)[1] for n in names] == [
        s.address.rsplit(":", 1)[1] for s in shards.schedulers
    ]
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(6, 40))] for _ in range(8)]
    requests = [
        (f"greedy-{i}", {"prompt": p, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0})
        for i, p in enumerate(prompts)
    ]
    received = asyncio.run(run_workload(shards.gateway.address, requests))  # type: ignore[union-attr]
    expected = hf_greedy_outputs(load_hf(tiny_model_dir), prompts, 12)
    assert [received[f"greedy-{i}"].token_ids[0] for i in range(8)] == expected
    # Both shards served some of them (placement by prefix spreads distinct prompts).
    steps = [sum(r.num_steps for r in shards.stats(s).replicas) for s in shards.schedulers]
    assert all(n > 0 for n in steps), steps
    for shard in shards.schedulers:
        shards.assert_no_leak(shard)


def test_a_killed_shard_loses_no_stream_and_its_workers_move(shards: FleetStack):
    baseline: dict[str, Received] = asyncio.run(run_workload(shards.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    lost, survivor = shards.schedulers
    fired: list[int] = []

    def kill(total: int) -> None:
        if total >= 40 and not fired:
            fired.append(total)
            lost.kill()

    received = asyncio.run(run_workload(shards.gateway.address, WORKLOAD, kill))  # type: ignore[union-attr]
    assert fired, "the workload ended before the shard was killed"
    assert_same_outputs(baseline, received)
    # The lost shard's two workers registered with the survivor, which drives all four.
    shards.wait_for(
        lambda s: len(shards.ready_replicas(s)) == 4, "workers taken over", scheduler=survivor
    )
    gateway_log = shards.gateway.log.read_text(errors="replace")  # type: ignore[union-attr]
    # The gateway moves the lost shard's requests when its stream breaks, or earlier when the
    # readiness watch sees the shard without a ready worker (move_off_idle_shards): whichever
    # notices first moves them, and the other finds none left.
    assert (
        '"event": "requests moved to other shards"' in gateway_log
        or '"event": "requests moved off a shard without a ready worker"' in gateway_log
    )
    shards.assert_no_leak(survivor)
    # The killed shard restarts with no worker (they stay where they are) and the stack keeps
    # serving: the gateway places requests on the shard that has workers.
    lost.start(wait=False)
    shards.wait_for(lambda _: True, "the restarted shard answers", scheduler=lost)
    again = asyncio.run(run_workload(shards.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    assert_same_outputs(baseline, again)
    assert ready_on(shards, lost) == 0
    shards.assert_no_leak(survivor)
