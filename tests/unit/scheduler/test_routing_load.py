"""Routing's per-replica load is kept between placements until the replica's state changes:
every pick sees requests added or aborted since the last one, and a scheduled step, exactly as
a fresh count over the queues would."""

from __future__ import annotations

from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.fleet.placement import Candidate, ReplicaChooser, RoutingPolicy, load_tokens

from .fake_model import FakeModel

BLOCK = 4
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def make_engine() -> LLMEngine:
    return LLMEngine(
        SchedulerConfig(8, 64, 64, True),
        CacheConfig(BLOCK, 32, 16, watermark=0.0),
        FakeModel(32, 16, BLOCK),
    )


def test_every_pick_sees_the_load_a_fresh_count_gives():
    engines = [make_engine(), make_engine()]
    candidates = [Candidate(i, e) for i, e in enumerate(engines)]
    router = ReplicaChooser(RoutingPolicy.LEAST_LOADED)
    for i in range(6):
        decision = router.pick(candidates, [1, 2, 3])
        assert decision is not None
        chosen = engines[decision.replica_id]
        assert decision.load_tokens == load_tokens(chosen)
        chosen.add_request(f"r{i}", list(range(1, 8 + i)), PARAMS)
    loads = [load_tokens(e) for e in engines]
    assert all(load > 0 for load in loads)  # least loaded alternates while loads are close
    engines[0].abort_request("r0")
    assert router.pick(candidates[:1], [1]).load_tokens == load_tokens(engines[0]) < loads[0]
    # A scheduled step computes prompt tokens: the next pick counts again.
    engines[1].step()
    assert router.pick(candidates[1:], [1]).load_tokens == load_tokens(engines[1]) < loads[1]


def test_a_replica_with_a_new_engine_is_counted_afresh():
    router = ReplicaChooser(RoutingPolicy.CACHE_AWARE)
    old = make_engine()
    old.add_request("r", list(range(1, 20)), PARAMS)
    assert router.pick([Candidate(0, old)], [1]).load_tokens == load_tokens(old) > 0
    new = make_engine()  # the replica reconnected with a fresh engine: same id, same stamp
    assert router.pick([Candidate(0, new)], [1]).load_tokens == 0
