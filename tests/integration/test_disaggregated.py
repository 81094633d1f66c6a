"""Disaggregated prefill and decode with real processes (issue #29): one prefill worker and one
decode worker of the embedded SmolLM2 serve the exactness prompts with HF's greedy output. Each
request prefills on the prefill worker, which samples its first token; then it stops there and
moves to the decode worker with its KV blocks (worker to worker), where it decodes the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from tests.support.fleet import FleetStack, run_workload, start_fleet
from tests.support.models import EXACT_MODE_ARGS, SMOLLM2_EXACTNESS_NEW, smollm2_exactness

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

WORKER_ARGS = [
    "--max-model-len", "1024", "--kv-cache-memory", "0.1", "--num-threads", "1",
    *EXACT_MODE_ARGS,
]  # fmt: skip


# Prompts with fewer tokens than this prefill on the decode worker; the rest hand off.
LOCAL_BELOW = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    started = start_fleet(
        "smollm2",
        tmp_path_factory.mktemp("disaggregated"),
        2,
        scheduler_args=["--prefill-local-below", str(LOCAL_BELOW)],
        worker_args=WORKER_ARGS,
        per_worker_args=[["--role", "prefill"], ["--role", "decode"]],
    )
    yield started
    started.stop()


def scheduler_events(stack: FleetStack, event: str) -> list[dict]:  # type: ignore[type-arg]
    lines = stack.scheduler.log.read_text(errors="replace").splitlines()  # type: ignore[union-attr]
    return [json.loads(line) for line in lines if f'"event": "{event}"' in line]


def test_one_prefill_and_one_decode_worker_serve_hf_equal_greedy_output(stack: FleetStack):
    prompts, expected = smollm2_exactness()
    requests = [
        (f"pd-{i}", {"prompt": p, "max_tokens": SMOLLM2_EXACTNESS_NEW, "temperature": 0.0,
                     "ignore_eos": True})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    received = asyncio.run(run_workload(stack.gateway.address, requests))  # type: ignore[union-attr]
    assert [received[f"pd-{i}"].token_ids[0] for i in range(len(prompts))] == expected
    handed_off = {f"pd-{i}" for i, p in enumerate(prompts) if len(p) >= LOCAL_BELOW}
    assert handed_off and len(handed_off) < len(prompts), "both paths are exercised"
    prefill, decode = (w.address for w in stack.workers)
    moved = scheduler_events(stack, "request moved with its KV blocks")
    assert {m["request"].split("/", 1)[1] for m in moved} == handed_off
    assert all(m["from_worker"] == prefill and m["to_worker"] == decode for m in moved)
    assert any(m["blocks"] > 0 for m in moved)
    migrated = scheduler_events(stack, "request migrated")
    assert len(migrated) == len(handed_off)
    assert {(m["cause"], m["how"]) for m in migrated} == {("prefill_done", "transfer")}
    stats = stack.stats()
    steps = {r.address: r.num_steps for r in stats.replicas}
    assert steps[prefill] > 0 and steps[decode] > steps[prefill]
    stack.assert_no_leak()
