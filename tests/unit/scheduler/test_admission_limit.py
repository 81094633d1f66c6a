"""The waiting-queue limit refuses new requests and never a re-submission: a request its
gateway sends again after losing a shard was admitted once, with or without tokens streamed."""

from __future__ import annotations

import asyncio

import grpc

from llmserve.proto_convert import sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2
from scheduler_service.engine import SchedulerConfig
from scheduler_service.fleet.admission import SchedulerAdmission
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
from scheduler_service.fleet.router import Router


def add(request_id: str, resubmitted: bool = False) -> scheduler_pb2.AddRequest:
    return scheduler_pb2.AddRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=sampling_params_to_proto(SamplingParams(max_tokens=4)),
        resubmitted=resubmitted,
    )


def test_a_resubmission_is_taken_beyond_the_waiting_limit():
    async def main() -> list[scheduler_pb2.SchedulerMessage]:
        # No worker: every admitted request waits, so one fills the queue.
        router = Router(
            FleetConfig(ReplicaConfig(SchedulerConfig(8, 64, 64, True))),
            admission=SchedulerAdmission(max_waiting=1),
        )
        stream = router.open_stream("gateway")
        router.add(stream, add("first"))
        router.add(stream, add("new"))
        router.add(stream, add("moved", resubmitted=True))
        messages = []
        while not stream.outbox.empty():
            messages.append(stream.outbox.get_nowait())
        router.close_stream(stream)
        return messages

    messages = asyncio.run(main())
    errors = [m.error for m in messages if m.WhichOneof("kind") == "error"]
    assert [(e.request_id, e.code) for e in errors] == [
        ("new", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    ]
