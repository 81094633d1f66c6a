"""Deferred token masks: a step's masks that arrive after the step itself.

A step may name constrained sequences whose masks are not in it
(`StepInput.deferred_mask_seq_ids`): the scheduler computes them while this worker runs the
step's forward pass and sends them on the same Execute stream (`ExecuteRequest.step_masks`).
The stream's reader posts them here (`MaskBoard.post`, on the event loop) and the model thread
takes them just before sampling (`MaskBoard.take`), waiting if they have not come yet. The
wait is bounded, and ends at once when the stream closes, so a scheduler that dies or a link
that breaks fails the step instead of hanging the worker.
"""

from __future__ import annotations

import threading
import time

from llmserve.steps import TokenMask


class MaskWaitError(RuntimeError):
    """A step's deferred masks did not come (timeout, or the stream closed)."""


class MaskBoard:
    """The deferred masks of one Execute stream's steps, by step id, until sampling takes them."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._masks: dict[int, list[TokenMask]] = {}
        self._closed = False

    def post(self, step_id: int, masks: list[TokenMask]) -> None:
        """The masks of step `step_id` arrived."""
        with self._cond:
            if step_id in self._masks:
                raise ValueError(f"step_masks: the masks of step {step_id} came twice")
            self._masks[step_id] = masks
            self._cond.notify_all()

    def take(self, step_id: int) -> tuple[list[TokenMask], int]:
        """The masks of step `step_id` and how long this waited for them (ns). Raises
        `MaskWaitError` when they do not come within the timeout or the board closes."""
        start = time.perf_counter_ns()
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while step_id not in self._masks:
                if self._closed:
                    raise MaskWaitError(
                        f"step {step_id}: the Execute stream closed before its masks came"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MaskWaitError(
                        f"step {step_id}: its masks did not come within "
                        f"{self._timeout_s:g} s (--mask-wait-timeout-s)"
                    )
                self._cond.wait(left)
            masks = self._masks.pop(step_id)
        return masks, time.perf_counter_ns() - start

    def close(self) -> None:
        """The stream ended: every wait ends now, with `MaskWaitError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
