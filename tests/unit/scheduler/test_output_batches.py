"""The Connect stream's batches (scheduler_service.fleet.messages.take_batch): what the scheduler
had queued for a gateway goes out in as few writes as the rules allow, in order, and the
gateway's reader (gateway.inflight.unbatched) gets every message back."""

from __future__ import annotations

import asyncio

from gateway.inflight import unbatched
from llmserve.v1 import scheduler_pb2
from scheduler_service.fleet.messages import MAX_BATCH, OutboxBatches, take_batch

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


def fill(slot: scheduler_pb2.SchedulerMessage, request_id: str, token: int) -> None:
    slot.output.request_id = request_id
    slot.output.choices.add(index=0, token_ids=[token])


def drained(queue: Queue) -> list[scheduler_pb2.SchedulerMessage]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_steps_outputs_go_to_each_outbox_as_one_batch_in_order() -> None:
    first, second = queue_of(), queue_of()
    batches = OutboxBatches()
    for i, (outbox, request_id) in enumerate([(first, "a"), (second, "x"), (first, "b")]):
        fill(batches.slot(outbox), request_id, i)
    assert first.empty() and second.empty()  # nothing is queued before the flush
    batches.flush()
    sent_first, sent_second = drained(first), drained(second)
    assert [m.WhichOneof("kind") for m in sent_first] == ["batch"]
    assert ids(sent_first) == ["a", "b"] and ids(sent_second) == ["x"]
    assert list(sent_first[0].batch.messages[1].output.choices[0].token_ids) == [2]


def test_a_message_alone_keeps_its_place_between_batches() -> None:
    outbox = queue_of()
    batches = OutboxBatches()
    fill(batches.slot(outbox), "a", 1)
    batches.alone(outbox, output("p", [5], prompt_logprobs=2))
    fill(batches.slot(outbox), "b", 2)
    batches.flush()
    sent = drained(outbox)
    assert [m.WhichOneof("kind") for m in sent] == ["batch", "output", "batch"]
    assert ids(sent) == ["a", "p", "b"]


def test_an_outbox_batch_holds_at_most_max_batch_messages() -> None:
    outbox = queue_of()
    batches = OutboxBatches()
    for i in range(MAX_BATCH + 3):
        fill(batches.slot(outbox), f"r{i}", i)
    batches.flush()
    sent = drained(outbox)
    assert [len(m.batch.messages) for m in sent] == [MAX_BATCH, 3]
    assert ids(sent) == [f"r{i}" for i in range(MAX_BATCH + 3)]


def test_a_built_batch_is_written_as_it_is_never_inside_another() -> None:
    outbox = queue_of()
    batches = OutboxBatches()
    fill(batches.slot(outbox), "b", 2)
    batches.flush()
    outbox.put_nowait(output("c", [3]))
    sent = take_batch(output("a", [1]), outbox)
    assert [m.WhichOneof("kind") for m in sent] == ["output", "batch", "output"]
    assert ids(sent) == ["a", "b", "c"]
    assert all(m.WhichOneof("kind") != "batch" for m in sent[1].batch.messages)
