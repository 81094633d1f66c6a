"""The Connect stream's batches (scheduler_service.fleet.messages.take_batch): what the scheduler
had queued for a gateway goes out in as few writes as the rules allow, in order, and the
gateway's reader (gateway.inflight.unbatched) gets every message back."""

from __future__ import annotations

import asyncio

from gateway.inflight import unbatched
from llmserve.v1 import scheduler_pb2
from scheduler_service.fleet.messages import MAX_BATCH, take_batch

Queue = asyncio.Queue[scheduler_pb2.SchedulerMessage | None]


def output(request_id: str, tokens: list[int], prompt_logprobs: int = 0):
    out = scheduler_pb2.RequestOutput(request_id=request_id)
    out.choices.add(index=0, token_ids=tokens)
    for _ in range(prompt_logprobs):
        out.prompt_logprobs.add(position=1)
    return scheduler_pb2.SchedulerMessage(output=out)


def error(request_id: str):
    return scheduler_pb2.SchedulerMessage(
        error=scheduler_pb2.RequestError(request_id=request_id, code=8, message="no room")
    )


def queue_of(*items: scheduler_pb2.SchedulerMessage | None) -> Queue:
    queue: Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def ids(messages: list[scheduler_pb2.SchedulerMessage]) -> list[str]:
    return [
        m.output.request_id if m.WhichOneof("kind") == "output" else f"error:{m.error.request_id}"
        for message in messages
        for m in unbatched(message)
    ]


def test_a_lone_message_goes_as_it_is() -> None:
    first = output("a", [1])
    assert take_batch(first, queue_of()) == [first]


def test_queued_outputs_and_errors_go_in_one_batch_in_order() -> None:
    queue = queue_of(output("b", [2]), error("c"), output("a", [3, 4]))
    sent = take_batch(output("a", [1]), queue)
    assert [m.WhichOneof("kind") for m in sent] == ["batch"]
    assert ids(sent) == ["a", "b", "error:c", "a"]
    assert list(sent[0].batch.messages[3].output.choices[0].token_ids) == [3, 4]
    assert queue.empty()


def test_prompt_logprobs_go_alone_and_split_the_runs_around_them() -> None:
    queue = queue_of(output("b", [2]), output("p", [5], prompt_logprobs=3), output("c", [6]))
    sent = take_batch(output("a", [1]), queue)
    assert [m.WhichOneof("kind") for m in sent] == ["batch", "output", "output"]
    assert ids(sent) == ["a", "b", "p", "c"]
    assert len(sent[1].output.prompt_logprobs) == 3


def test_the_streams_end_stays_queued_behind_the_batch() -> None:
    queue = queue_of(output("b", [2]), None)
    sent = take_batch(output("a", [1]), queue)
    assert ids(sent) == ["a", "b"]
    assert queue.qsize() == 1 and queue.get_nowait() is None


def test_a_batch_holds_at_most_max_batch_messages() -> None:
    queue = queue_of(*(output(f"r{i}", [i]) for i in range(1, MAX_BATCH + 5)))
    sent = take_batch(output("r0", [0]), queue)
    assert len(sent) == 1 and len(sent[0].batch.messages) == MAX_BATCH
    assert queue.qsize() == 5
    assert take_batch(queue.get_nowait(), queue)[0].batch.messages[0].output.request_id == (
        f"r{MAX_BATCH}"
    )


def test_unbatched_passes_single_messages_through() -> None:
    single = error("x")
    assert unbatched(single) == [single]
