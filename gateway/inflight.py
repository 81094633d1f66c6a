"""What the gateway keeps of a request submitted to the scheduler (enough to send it again),
the messages one read of a Connect stream carries, and what one write of it sends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmserve.v1 import common_pb2, scheduler_pb2

Inbox = asyncio.Queue[scheduler_pb2.SchedulerMessage]
Outbox = asyncio.Queue[scheduler_pb2.GatewayMessage | None]

# One write to the scheduler carries at most this many adds and aborts, and stops taking more
# once it holds this many prompt tokens (5 MiB or so: well under --max-message-bytes).
MAX_BATCH = 256
MAX_BATCH_PROMPT_TOKENS = 1 << 20


@dataclass(slots=True)
class ReceivedChoice:
    """One choice's deltas so far, kept as Python values (extending a proto's repeated fields
    per token cost several times more) and made a ContinuedChoice only for a re-submission."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.OutputLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: int = 0
    stop_token_id: int | None = None

    def to_proto(self) -> scheduler_pb2.ContinuedChoice:
        return scheduler_pb2.ContinuedChoice(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            stop_token_id=self.stop_token_id,
        )


@dataclass(slots=True, eq=False)
class InFlight:
    """A submitted request as this gateway knows it: enough to send it again."""

    add: scheduler_pb2.AddRequest
    inbox: Inbox
    # Choices stream as they grow (no best_of > n, no beam search), so a re-submission can
    # continue them; the others restart from the prompt (their seed makes that reproduce).
    streams_choices: bool
    # Everything received so far, per choice index.
    choices: dict[int, ReceivedChoice] = field(default_factory=dict)
    prompt_logprobs_received: bool = False
    # Its last message (finished output or error) was received: never sent again.
    done: bool = False
    # While it waits for a scheduler: fails it when the wait exceeds the timeout.
    expiry: asyncio.TimerHandle | None = None
    # The shard whose stream it was last sent on; None while it waits for one.
    shard: str | None = None
    # It has been sent on some shard's stream: every later send is a re-submission.
    sent: bool = False

    def record(self, output: scheduler_pb2.RequestOutput) -> None:
        if output.prompt_logprobs:
            self.prompt_logprobs_received = True
        self.done = output.finished
        if not self.streams_choices:
            return  # choices arrive only with the last message
        for delta in output.choices:
            choice = self.choices.get(delta.index)
            if choice is None:
                choice = self.choices[delta.index] = ReceivedChoice(delta.index)
            _fold(choice, delta)

    def resubmission(self) -> scheduler_pb2.AddRequest:
        """The AddRequest to send now: the first one as submitted; a later one marked
        `resubmitted`, with a continuation of what was received."""
        add = scheduler_pb2.AddRequest()
        add.CopyFrom(self.add)
        add.resubmitted = self.sent
        if self.choices:
            add.continuation.choices.extend(
                self.choices[i].to_proto() for i in sorted(self.choices)
            )
        return add

    def stop_waiting(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None


def absorb(output: scheduler_pb2.RequestOutput, later: scheduler_pb2.RequestOutput) -> None:
    """Fold `later`, the next output of the same request, into `output`: each choice's new
    tokens (and logprobs) joined, the later finish, usage and timings taken. A client that
    falls behind then gets what queued up for it in one chunk, one write (vLLM's server
    merges a slow consumer's outputs too)."""
    choices = {c.index: c for c in output.choices}
    for delta in later.choices:
        choice = choices.get(delta.index)
        if choice is None:
            choices[delta.index] = choice = output.choices.add(index=delta.index)
        _fold(choice, delta)
    output.prompt_logprobs.extend(later.prompt_logprobs)
    if later.finished:
        output.finished = True
        output.usage.CopyFrom(later.usage)
        output.metrics.CopyFrom(later.metrics)


def _fold(
    choice: ReceivedChoice | scheduler_pb2.ChoiceDelta, delta: scheduler_pb2.ChoiceDelta
) -> None:
    """Append `delta`, the choice's next news, to what `choice` holds."""
    choice.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)
    choice.cumulative_logprob = delta.cumulative_logprob
    if delta.finish_reason:
        choice.finish_reason = delta.finish_reason
    if delta.HasField("stop_token_id"):
        choice.stop_token_id = delta.stop_token_id


def unbatched(message: scheduler_pb2.SchedulerMessage) -> list[scheduler_pb2.SchedulerMessage]:
    """The outputs and errors a message read from a Connect stream carries, in order."""
    if message.WhichOneof("kind") == "batch":
        return list(message.batch.messages)
    return [message]


async def outgoing(outbox: Outbox) -> AsyncIterator[scheduler_pb2.GatewayMessage]:
    """A Connect stream's requests: what `outbox` holds at each write, batched, until None."""
    while (first := await outbox.get()) is not None:
        yield take_batch(first, outbox)


def take_batch(first: scheduler_pb2.GatewayMessage, outbox: Outbox) -> scheduler_pb2.GatewayMessage:
    """`first` and whatever else `outbox` holds now, up to MAX_BATCH messages and until they
    hold MAX_BATCH_PROMPT_TOKENS prompt tokens, as one message (a batch when there are
    several). The stream's end (None) stays in the queue for the next write."""
    messages = [first]
    tokens = len(first.add.prompt_token_ids)
    while len(messages) < MAX_BATCH and tokens < MAX_BATCH_PROMPT_TOKENS and not outbox.empty():
        item = outbox.get_nowait()
        if item is None:
            outbox.put_nowait(None)  # nothing is behind it: it stays last
            break
        messages.append(item)
        tokens += len(item.add.prompt_token_ids)
    if len(messages) == 1:
        return first
    return scheduler_pb2.GatewayMessage(batch=scheduler_pb2.GatewayMessageBatch(messages=messages))
