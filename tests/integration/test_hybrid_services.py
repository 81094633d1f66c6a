"""A hybrid model through real services: a tiny Qwen3.5 (Gated DeltaNet layers, whose state
lives in a slot per sequence, beside gated attention layers; SmolLM2's tokenizer:
tests/support/models.py build_tiny_hybrid), eight long streams (greedy and seeded, one n=2).

A worker SIGKILLed mid-run, the scheduler restarted mid-run and a drain each leave every
stream as the undisturbed run ended it, and every block and state slot free. A drain moves
the requests with their KV blocks and a state snapshot at the last block boundary: the new
worker starts them from it (a prefix-cache hit there, which needs the snapshot). One prefill
worker and one decode worker give HF's greedy tokens, the prompts handed off the same way
(short prompts prefill on the decode worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.integration.test_kv_migration import events, long_workload, run_with
from tests.support.fleet import (
    FleetStack,
    Received,
    assert_same_outputs,
    run_workload,
    spare_worker,
    start_fleet,
)
from tests.support.models import build_tiny_hybrid, load_hf

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

WORKLOAD = long_workload(count=8, seed=11, max_tokens=96)
SCHEDULER_ARGS = ["--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def fleet(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start_fleet(
        str(hybrid_dir), tmp_path_factory.mktemp("hybrid-fleet"), 2, scheduler_args=SCHEDULER_ARGS
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def baseline(fleet: FleetStack) -> dict[str, Received]:
    received = asyncio.run(run_workload(fleet.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    fleet.assert_no_leak()
    stats = fleet.stats()
    assert all(r.state_slots_total > 0 for r in fleet.ready_replicas(stats)), stats
    return received


def run_with_fault(stack: FleetStack, fault: Callable[[], None]) -> dict[str, Received]:
    """The workload; `fault()` runs on a thread once every stream is past its prompt."""
    return run_with(stack, fault, 8 * len(WORKLOAD), WORKLOAD)


def test_worker_kill_and_scheduler_restart_change_no_stream(
    fleet: FleetStack, baseline: dict[str, Received]
) -> None:
    victim = fleet.workers[0]
    assert_same_outputs(baseline, run_with_fault(fleet, victim.kill))
    fleet.assert_no_leak()
    victim.start()
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "the restarted worker ready")

    scheduler = fleet.scheduler
    assert scheduler is not None

    def restart() -> None:
        scheduler.kill()
        scheduler.start(wait=False)

    assert_same_outputs(baseline, run_with_fault(fleet, restart))
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "workers back")
    fleet.assert_no_leak()


def test_a_drain_changes_no_stream(
    hybrid_dir: Path, tmp_path: Path, baseline: dict[str, Received]
) -> None:
    stack = start_fleet(str(hybrid_dir), tmp_path / "drain", 1, scheduler_args=SCHEDULER_ARGS)
    try:
        source = stack.workers[0].address
        spare = spare_worker(stack, "spare")

        def move_off() -> None:
            stack.lease(spare.address)
            stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
            stack.drain(source)

        assert_same_outputs(baseline, run_with_fault(stack, move_off))
        stack.wait_for(lambda s: source not in {r.address for r in s.replicas}, "the drain")
        assert events(stack, "request moved with its KV blocks")
        (target,) = stack.stats().replicas
        assert target.prefix_cache_hits > 0  # started from a snapshot that travelled
        stack.assert_no_leak()
    finally:
        stack.stop()


def test_one_prefill_and_one_decode_worker_give_hf_greedy_tokens(
    hybrid_dir: Path, tmp_path: Path
) -> None:
    hf = load_hf(hybrid_dir)
    # Below --prefill-local-below, the last prompt prefills on the decode worker.
    prompts = [request["prompt"][:40] for _, request in WORKLOAD[:3]] + [
        WORKLOAD[3][1]["prompt"][:5]
    ]
    new_tokens = 24
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    stack = start_fleet(
        str(hybrid_dir),
        tmp_path / "pd",
        2,
        scheduler_args=["--prefill-local-below", "8"],
        per_worker_args=[["--role", "prefill"], ["--role", "decode"]],
    )
    try:
        requests = [
            (f"pd-{i}", {"prompt": p, "max_tokens": new_tokens, "temperature": 0.0,
                         "ignore_eos": True})
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        received = asyncio.run(run_workload(stack.gateway.address, requests))  # type: ignore[union-attr]
        assert [received[f"pd-{i}"].token_ids[0] for i in range(len(prompts))] == expected
        replicas = stack.stats().replicas
        assert all(r.num_steps > 0 for r in replicas), replicas  # both workers computed
        # Each long prompt stops on the prefill worker at its first token and moves; on
        # failure: each replica's role and where the requests went.
        placed = (events(stack, "replica ready"), events(stack, "request migrated"), replicas)
        assert len(events(stack, "request moved with its KV blocks")) == 3, placed
        decode = next(r for r in replicas if r.address == stack.workers[1].address)
        assert decode.prefix_cache_hits > 0  # the handed-off prompts' snapshots
        stack.assert_no_leak()
    finally:
        stack.stop()
