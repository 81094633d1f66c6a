"""Batch limits: what a worker adopts from the scheduler, what it refuses, and the flags of both
services (one default each, in llmserve/batch_limits.py)."""

from __future__ import annotations

import pytest

from llmserve.batch_limits import (
    BatchLimits,
    GivenBatchLimits,
    adopt_batch_limits,
)
from llmserve.errors import FieldError
from llmserve.proto_convert import batch_limits_from_proto
from llmserve.v1 import worker_pb2
from scheduler_service.__main__ import parse_args as scheduler_args
from scheduler_service.engine.config import SchedulerConfig
from worker_service.__main__ import build_config
from worker_service.__main__ import parse_args as worker_args

NONE = GivenBatchLimits()


@pytest.mark.parametrize(
    ("own", "sent", "adopted"),
    [
        (NONE, NONE, BatchLimits(256, 2048)),  # nothing given: the defaults
        (NONE, GivenBatchLimits(8, 64), BatchLimits(8, 64)),  # the scheduler's
        (NONE, GivenBatchLimits(max_num_seqs=8), BatchLimits(8, 2048)),
        (GivenBatchLimits(16, None), NONE, BatchLimits(16, 2048)),  # alone: its own flags
        (GivenBatchLimits(8, 512), GivenBatchLimits(8, 512), BatchLimits(8, 512)),  # agreed
        # A flag pins only its own limit; the other follows the scheduler.
        (GivenBatchLimits(8, None), GivenBatchLimits(8, 96), BatchLimits(8, 96)),
    ],
)
def test_adopted_limits(own: GivenBatchLimits, sent: GivenBatchLimits, adopted: BatchLimits):
    assert adopt_batch_limits(own, sent) == adopted


def test_a_worker_flag_that_disagrees_with_the_scheduler_is_refused_by_name():
    with pytest.raises(FieldError) as refused:
        adopt_batch_limits(GivenBatchLimits(max_num_seqs=16), GivenBatchLimits(8, 2048))
    assert refused.value.field == "max_num_seqs"
    assert str(refused.value) == (
        "max_num_seqs: the scheduler sends 8, but this worker was started with "
        "--max-num-seqs 16; start the worker without --max-num-seqs (it follows the "
        "scheduler) or give both the same value"
    )
    with pytest.raises(FieldError) as tokens:
        adopt_batch_limits(GivenBatchLimits(8, 4096), GivenBatchLimits(8, 2048))
    assert tokens.value.field == "max_num_batched_tokens"
    assert "sends 2048, but this worker was started with --max-num-batched-tokens 4096" in str(
        tokens.value
    )


def test_a_limit_under_one_is_refused_by_name():
    with pytest.raises(FieldError, match=r"^max_num_seqs: must be at least 1, got 0$"):
        adopt_batch_limits(NONE, GivenBatchLimits(max_num_seqs=0))


def test_limits_from_an_initialize_cache_request():
    sent = worker_pb2.InitializeCacheRequest(num_gpu_blocks=8, max_num_seqs=8)
    assert batch_limits_from_proto(sent) == GivenBatchLimits(8, None)
    assert batch_limits_from_proto(worker_pb2.InitializeCacheRequest()) == NONE
    both = worker_pb2.InitializeCacheRequest(max_num_seqs=4, max_num_batched_tokens=32)
    assert batch_limits_from_proto(both) == GivenBatchLimits(4, 32)


def test_the_services_take_their_limits_from_one_place():
    scheduler = scheduler_args([])
    # The token budget unset: the scheduler decides it by its policy (`token_budget`).
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, None)
    worker = build_config(worker_args([]))
    assert worker.given_batch_limits == NONE
    assert build_config(worker_args(["--max-num-seqs", "8"])).given_batch_limits == (
        GivenBatchLimits(8, None)
    )
    engine = SchedulerConfig()
    assert BatchLimits(engine.max_num_seqs, engine.token_budget) == BatchLimits()
