"""The Connect stream's messages: engine outputs to protos, and a gateway's record back."""

from __future__ import annotations

import asyncio

from llmserve.errors import ApiError, grpc_status
from llmserve.proto_convert import finish_reason_to_proto, token_logprob_to_proto
from llmserve.resubmission import continuation_from_proto
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import scheduler_pb2
from scheduler_service.engine.request_output import CompletionOutput, RequestOutput
from scheduler_service.engine.sequence import FinishReason, RequestMetrics, SampleLogprobs
from scheduler_service.engine.snapshots import SequenceSnapshot


def record_sent(sent: dict[int, SequenceSnapshot], choices: list[CompletionOutput]) -> None:
    """Add a streamed delta to what the gateway has been sent."""
    for choice in choices:
        record = sent.get(choice.index)
        if record is None:
            record = sent[choice.index] = SequenceSnapshot(choice.index, [], [], 0.0, None, None)
        record.output_token_ids.extend(choice.token_ids)
        if choice.logprobs is not None:
            record.output_logprobs.extend(choice.logprobs)
        record.cumulative_logprob = choice.cumulative_logprob
        record.finish_reason = choice.finish_reason
        record.stop_token_id = choice.stop_token_id


def continued_choices(
    continuation: scheduler_pb2.Continuation, params: SamplingParams
) -> dict[int, SequenceSnapshot]:
    """The gateway's record of a request re-submitted after a scheduler restart."""
    choices = continuation_from_proto(continuation, params)
    return {
        c.index: SequenceSnapshot(
            c.index,
            c.token_ids,
            [SampleLogprobs(token, top) for token, top in c.logprobs],
            c.cumulative_logprob,
            None if c.finish_reason is None else FinishReason(c.finish_reason),
            c.stop_token_id,
        )
        for c in choices
    }


def error_message(request_id: str, exc: ApiError) -> scheduler_pb2.SchedulerMessage:
    code, message = grpc_status(exc)
    return scheduler_pb2.SchedulerMessage(
        error=scheduler_pb2.RequestError(
            request_id=request_id, code=code.value[0], message=message, field=exc.field or ""
        )
    )


def _fill_choice(msg: scheduler_pb2.ChoiceDelta, choice: CompletionOutput) -> None:
    msg.index = choice.index
    msg.token_ids.extend(choice.token_ids)
    msg.cumulative_logprob = choice.cumulative_logprob
    if choice.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(choice.finish_reason)
    if choice.stop_token_id is not None:
        msg.stop_token_id = choice.stop_token_id
    for lp in choice.logprobs or ():
        msg.logprobs.add(
            token=token_logprob_to_proto(lp.token),
            top=[token_logprob_to_proto(t) for t in lp.top],
        )


def _metrics_to_proto(m: RequestMetrics) -> scheduler_pb2.RequestMetrics:
    def ns(t: float | None) -> int:
        return 0 if t is None else max(int((t - m.arrival_time) * 1e9), 0)

    return scheduler_pb2.RequestMetrics(
        queue_ns=ns(m.first_scheduled_time),
        first_token_ns=ns(m.first_token_time),
        e2e_ns=ns(m.finished_time),
    )


def fill_output(
    msg: scheduler_pb2.RequestOutput,
    request_id: str,
    num_prompt_tokens: int,
    num_output_tokens: int,
    output: RequestOutput,
) -> None:
    """Write a delta for the gateway into `msg` (an empty one, usually a batch's slot: built in
    place, it is never copied); a finished one carries usage (`num_output_tokens`, the
    request's returned tokens) and timings."""
    msg.request_id = request_id
    for c in output.outputs:
        _fill_choice(msg.choices.add(), c)
    msg.finished = output.finished
    for p in output.prompt_logprobs or ():
        msg.prompt_logprobs.add(
            position=p.position,
            token=token_logprob_to_proto(p.token),
            top=[token_logprob_to_proto(t) for t in p.top],
        )
    if output.finished:
        msg.usage.prompt_tokens = num_prompt_tokens
        msg.usage.completion_tokens = num_output_tokens
        if output.metrics is not None:
            msg.metrics.CopyFrom(_metrics_to_proto(output.metrics))
            msg.usage.spec_draft_tokens = output.metrics.num_draft_tokens
            msg.usage.spec_accepted_tokens = output.metrics.num_accepted_tokens


# At most this many queued messages go out in one write (SchedulerMessage.batch).
MAX_BATCH = 256

Outbox = asyncio.Queue[scheduler_pb2.SchedulerMessage | None]


class OutboxBatches:
    """What one step sends each gateway: its messages written in place into one
    SchedulerMessage.batch per outbox (a new one after MAX_BATCH), queued by `flush`.

    A message built on its own and then batched is copied into the batch, and each queued
    message costs a queue put and get: per token, that was most of what the scheduler spent
    on a step's outputs for a gateway."""

    def __init__(self) -> None:
        self._open: dict[Outbox, scheduler_pb2.SchedulerMessage] = {}

    def slot(self, outbox: Outbox) -> scheduler_pb2.SchedulerMessage:
        """An empty message, next in `outbox`'s batch."""
        batch = self._open.get(outbox)
        if batch is None or len(batch.batch.messages) >= MAX_BATCH:
            if batch is not None:
                outbox.put_nowait(batch)
            batch = self._open[outbox] = scheduler_pb2.SchedulerMessage()
        return batch.batch.messages.add()

    def alone(self, outbox: Outbox, message: scheduler_pb2.SchedulerMessage) -> None:
        """Queue `message` by itself (an output with prompt logprobs), after what `outbox`'s
        batch holds so far."""
        batch = self._open.pop(outbox, None)
        if batch is not None:
            outbox.put_nowait(batch)
        outbox.put_nowait(message)

    def flush(self) -> None:
        for outbox, batch in self._open.items():
            outbox.put_nowait(batch)
        self._open.clear()


def take_batch(
    first: scheduler_pb2.SchedulerMessage, outbox: Outbox
) -> list[scheduler_pb2.SchedulerMessage]:
    """`first` and whatever else `outbox` holds now (up to MAX_BATCH messages in all), as the
    messages to write: runs of outputs and errors as one batch each, an output that carries
    prompt logprobs alone, a batch already built (`OutboxBatches`) as it is. The stream's end
    (None) stays in the queue for the next read.

    Each write to a Connect stream costs the scheduler a gRPC write and a turn of its event
    loop; one step's outputs to a gateway, written one by one, cost that per token."""
    pending = [first]
    while len(pending) < MAX_BATCH and not outbox.empty():
        item = outbox.get_nowait()
        if item is None:
            outbox.put_nowait(None)  # nothing was behind it: it stays last
            break
        pending.append(item)
    messages: list[scheduler_pb2.SchedulerMessage] = []
    run: list[scheduler_pb2.SchedulerMessage] = []

    def flush() -> None:
        if len(run) == 1:
            messages.append(run[0])
        elif run:
            batch = scheduler_pb2.SchedulerMessageBatch(messages=run)
            messages.append(scheduler_pb2.SchedulerMessage(batch=batch))
        run.clear()

    for message in pending:
        kind = message.WhichOneof("kind")
        if kind == "batch" or (kind == "output" and message.output.prompt_logprobs):
            flush()
            messages.append(message)
        else:
            run.append(message)
    flush()
    return messages
