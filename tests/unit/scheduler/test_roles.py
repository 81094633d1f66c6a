"""Placement by worker role (`scheduler_service.fleet.roles.choose`): long prompts to prefill workers
when both pools are ready, short or mostly cached ones and every move to decode workers."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.v1 import worker_pb2
from scheduler_service.fleet.placement import Decision
from scheduler_service.fleet.roles import choose, role_name

PREFILL, DECODE, MIXED = (
    worker_pb2.WORKER_ROLE_PREFILL,
    worker_pb2.WORKER_ROLE_DECODE,
    worker_pb2.WORKER_ROLE_MIXED,
)


@dataclass
class FakeReplica:
    replica_id: int
    info: worker_pb2.InfoResponse
    cached: int  # prompt tokens its prefix cache holds


def replicas(*specs: tuple[int, int]) -> list[FakeReplica]:
    return [
        FakeReplica(i, worker_pb2.InfoResponse(role=role), cached)
        for i, (role, cached) in enumerate(specs)
    ]


def route(candidates, prompt):  # type: ignore[no-untyped-def]
    """Most cached tokens first, then the lowest id (a stand-in for the routing policy)."""
    if not candidates:
        return None
    best = max(candidates, key=lambda r: (r.cached, -r.replica_id))
    return best, Decision(best.replica_id, best.cached, 0)


def picked(ready, prompt_len: int, local_below: int | None) -> int:  # type: ignore[no-untyped-def]
    result = choose(ready, list(range(prompt_len)), local_below, route)
    assert result is not None
    return result[0].replica_id


def test_long_prompts_go_to_prefill_workers_and_short_ones_stay_on_decode_workers():
    ready = replicas((PREFILL, 0), (DECODE, 0))
    assert picked(ready, 128, 128) == 0
    assert picked(ready, 127, 128) == 1
    # Mostly cached on a decode worker: what is left to prefill is short.
    cached = replicas((PREFILL, 0), (DECODE, 900))
    assert picked(cached, 1000, 128) == 1
    assert picked(cached, 1028, 128) == 0


def test_moves_go_to_decode_or_mixed_workers_whatever_the_prompt():
    ready = replicas((PREFILL, 5000), (DECODE, 0), (MIXED, 10))
    assert picked(ready, 5000, None) == 2  # the mixed one holds more of it
    assert picked(replicas((PREFILL, 0), (DECODE, 0)), 5000, None) == 1


def test_one_pool_alone_takes_everything():
    assert picked(replicas((PREFILL, 0), (PREFILL, 3)), 10, 128) == 1
    assert picked(replicas((DECODE, 0), (MIXED, 0)), 4000, 128) == 0
    assert picked(replicas((MIXED, 0)), 4000, None) == 0
    assert choose([], [1, 2], 128, route) is None


def test_a_replica_without_info_is_mixed():
    replica = FakeReplica(0, None, 0)  # type: ignore[arg-type]
    assert role_name(replica) == "mixed"  # type: ignore[arg-type]
    assert [role_name(r) for r in replicas((PREFILL, 0), (DECODE, 0))] == ["prefill", "decode"]  # type: ignore[arg-type]
