"""Scheduling policy: the per-step budget, the order of the queues, and how a group is
preempted.

Decisions only; the `Scheduler` moves groups between its queues and the block manager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.sequence import SequenceGroup


@dataclass(slots=True)
class SchedulingBudget:
    """Tokens and sequences one step may still take on (`max_num_batched_tokens`,
    `max_num_seqs`)."""

    token_budget: int
    seq_budget: int
    num_tokens: int = 0
    num_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_tokens


def preemption_mode(forced: PreemptionMode | None, seq_group: SequenceGroup) -> PreemptionMode:
    """`forced` if set; otherwise RECOMPUTE for a group with one live sequence and SWAP for
    one with several (their shared blocks make recomputing them cost more than a copy).

    A SWAP the host swap space cannot take becomes a RECOMPUTE (`Scheduler._preempt`):
    siblings are recomputed together, sharing the prompt's blocks through the prefix cache.
    """
    if forced is not None:
        return forced
    if seq_group.get_max_num_running_seqs() == 1:
        return PreemptionMode.RECOMPUTE
    return PreemptionMode.SWAP


def insert_in_order(
    queue: deque[SequenceGroup], seq_group: SequenceGroup, ahead_of_ties: bool = False
) -> None:
    """Put `seq_group` after the groups that come before it in (priority, arrival) order
    (`SequenceGroup.order_key`), and after (or, with `ahead_of_ties`, before) its equals.

    Every queue is kept in this order. Admission takes `waiting` from the front, so the
    highest priority comes first and arrival breaks ties; preemption takes victims from the
    end of `running`, so it always takes the latest arrival of the lowest priority, however
    groups came back (swap-in, re-admission after recompute, a move from another replica).
    Victims are swapped out latest first and go back to `waiting` ahead of their equals, so
    `ahead_of_ties` keeps equal groups in their running order. Groups mostly arrive last, so
    the walk from the end is short.
    """
    key = seq_group.order_key()
    position = len(queue)
    while position and (
        queue[position - 1].order_key() > key
        or (ahead_of_ties and queue[position - 1].order_key() == key)
    ):
        position -= 1
    queue.insert(position, seq_group)
