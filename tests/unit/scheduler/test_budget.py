"""`max_num_seqs` bounds the groups running at once in both scheduling policies, on a
workload that keeps more requests waiting than the limit allows."""

from __future__ import annotations

import pytest

from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig

from .fake_model import FakeModel

MAX_SEQS = 2


@pytest.mark.parametrize("chunked", [False, True])
def test_never_more_than_max_num_seqs_running(chunked):
    engine = LLMEngine(
        SchedulerConfig(
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=64,
            max_model_len=64,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(4, 64, 0, watermark=0.0, enable_prefix_caching=False),
        FakeModel(64, 0, 4),
    )
    for i in range(8):
        engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=3 + i % 3))
    scheduler = engine.scheduler
    running_per_step = []
    finished = set()
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
        running_per_step.append(sum(g.get_max_num_running_seqs() for g in scheduler.running))
    assert finished == {f"r{i}" for i in range(8)}
    # The limit is reached (the test is not vacuous) and never passed.
    assert max(running_per_step) == MAX_SEQS
