"""One Execute stream's steps on the worker's model thread (see `StepChain`), the reader that
takes them off the stream (`read_steps`), and the stream's word on ending multi-step runs early
(`PassesEnd`). The servicer (server.py) wires them together."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmserve.proto_masks import step_masks_from_proto
from llmserve.step_proto import step_input_from_proto
from llmserve.steps import StepInput, StepResult, TokenMask
from llmserve.v1 import worker_pb2
from worker_service import metrics


@dataclass(slots=True)
class Received:
    """A step as it arrived on the Execute stream (or why it could not be read)."""

    step: StepInput | BaseException
    traceparent: str
    arrived_ns: int  # time.perf_counter_ns() when it was read off the stream


class PassesEnd:
    """Through which step the multi-step runs end early (`ExecuteRequest.end_passes`): set on
    the event loop as the stream's messages arrive, read on the model thread between passes
    (one int, replaced whole)."""

    def __init__(self) -> None:
        self.through_step_id = -1

    def post(self, through_step_id: int) -> None:
        self.through_step_id = max(self.through_step_id, through_step_id)

    def ends(self, step_id: int) -> bool:
        """Whether step `step_id`'s multi-step runs stop after the pass running now."""
        return step_id <= self.through_step_id


async def read_steps(
    requests: AsyncIterator[worker_pb2.ExecuteRequest],
    submit: Callable[[Received | None], None],
    post_masks: Callable[[int, list[TokenMask]], None],
    end_passes: Callable[[int], None],
) -> None:
    """Read steps as they arrive, while earlier ones run (asynchronous scheduling sends the
    next step before the previous result is back), converting them off the model's path;
    deferred masks go to `post_masks`, the word to end multi-step runs to `end_passes`. Ends
    with None when the stream ends; a step (or masks) that fails to convert, or a broken
    stream, is handed on as its exception."""
    try:
        async for message in requests:
            arrived = time.perf_counter_ns()
            step: StepInput | BaseException
            try:
                if message.HasField("step_masks"):
                    post_masks(*step_masks_from_proto(message.step_masks))
                    continue
                if message.HasField("end_passes"):
                    end_passes(message.end_passes.through_step_id)
                    continue
                step = step_input_from_proto(message)
            except Exception as exc:  # raised in order, when its turn comes
                step = exc
            submit(Received(step, message.traceparent, arrived))
    except Exception as exc:  # the stream broke; the Execute loop ends with it
        submit(Received(exc, "", time.perf_counter_ns()))
    finally:
        submit(None)


@dataclass(slots=True)
class Outcome:
    """A step's result and forward pass (start, end), or what it raised."""

    result: tuple[StepResult, tuple[int, int] | None] | BaseException
    arrived_ns: int


class StepChain:
    """One Execute stream's steps, run in order on the model thread, back to back: a step that
    arrived while the previous one ran starts on the model thread right after it, without a
    trip through the event loop. (Through the loop, a step waited for the loop to see the
    result and then for the model thread to see the step it was handed: bench/RESULTS.md,
    "Figures moved out of code comments".)
    Outcomes go to `outcomes` in order (through a relay thread, see __init__), then None once
    the steps end; a step that raises ends the chain, so no later step runs."""

    def __init__(
        self,
        model_thread: ThreadPoolExecutor,
        execute: Callable[[Received], tuple[StepResult, tuple[int, int] | None]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.outcomes: asyncio.Queue[Outcome | None] = asyncio.Queue()
        self._model_thread = model_thread
        self._execute = execute
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: deque[Received | None] = deque()
        self._running = False  # a `_drain` is queued or running on the model thread
        # perf_counter_ns when the model thread last ran out of steps (None: before the first
        # step, or while steps follow each other); the wait is observed when the next starts.
        self._idle_since: int | None = None
        self._closed = False
        # Outcomes reach the loop through a thread of their own. Handing one to the loop
        # directly wakes it with a write to its self-pipe, and while the model thread was in
        # that write the loop's thread took the GIL to send the result, and the next step
        # waited for it (bench/RESULTS.md, "Figures moved out of code comments"). Queued here
        # instead, an outcome goes to the loop once the model thread lets go of the GIL: in
        # the next forward pass's native code, or when it runs out of steps.
        self._outbox: queue.SimpleQueue[Outcome | None | _EndOfOutcomes] = queue.SimpleQueue()
        threading.Thread(target=self._relay, name="execute-outcomes", daemon=True).start()

    def submit(self, received: Received | None) -> None:
        """On the loop: queue a step (None: no more steps)."""
        with self._lock:
            if self._closed:
                return
            self._pending.append(received)
            if self._running:
                return
            self._running = True
        self._model_thread.submit(self._drain)

    def close(self) -> None:
        """No later step starts; outcomes already handed on still reach `outcomes`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
        self._outbox.put(_EndOfOutcomes())

    def _drain(self) -> None:
        """On the model thread: run queued steps until none is left."""
        while True:
            with self._lock:
                if self._closed or not self._pending:
                    self._running = False
                    self._idle_since = time.perf_counter_ns()
                    return
                received = self._pending.popleft()
            if received is None:
                self._post(None)
                continue
            if self._idle_since is not None:
                metrics.observe_step_wait((time.perf_counter_ns() - self._idle_since) / 1e9)
                self._idle_since = None
            try:
                outcome = Outcome(self._execute(received), received.arrived_ns)
            except BaseException as exc:  # handed to the Execute loop, which raises it
                self._post(Outcome(exc, received.arrived_ns))
                self.close()  # the next turn of the loop ends the drain
                continue
            self._post(outcome)

    def _post(self, outcome: Outcome | None) -> None:
        self._outbox.put(outcome)

    def _relay(self) -> None:
        """On its own thread: hand outcomes to the loop in order, until the chain closes."""
        while not isinstance(outcome := self._outbox.get(), _EndOfOutcomes):
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                self._loop.call_soon_threadsafe(self.outcomes.put_nowait, outcome)


class _EndOfOutcomes:
    """Ends a `StepChain`'s relay thread."""
