"""Scheduling policy: the per-step budget, the order of the queues, and how a group is
preempted.

Decisions only; the `Scheduler` moves groups between its queues and the block manager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_service.config import PreemptionMode
from scheduler_service.sequence import SequenceGroup


@dataclass(slots=True)
class SchedulingBudget:
    """Tokens and sequences one step may still take on (`max_num_batched_tokens`,
    `max_num_seqs`)."""

    max_tokens: int
    max_seqs: int
    num_tokens: int = 0
    num_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_tokens


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


def insert_by_arrival(
    queue: deque[SequenceGroup], seq_group: SequenceGroup, ahead_of_ties: bool = False
) -> None:
    """Put `seq_group` after the groups that arrived before it, and after (or, with
    `ahead_of_ties`, before) those that arrived at the same time.

    `running` and `swapped` are kept in arrival order so that preemption, which takes victims
    from the end of `running`, always takes the latest arrival, however groups came back
    (swap-in, re-admission after recompute, a move from another replica). Victims are swapped
    out latest first, so `ahead_of_ties` keeps equal arrivals in their running order. Groups
    mostly arrive last, so the walk from the end is short.
    """
    arrival = seq_group.arrival_time
    position = len(queue)
    while position and (
        queue[position - 1].arrival_time > arrival
        or (ahead_of_ties and queue[position - 1].arrival_time == arrival)
    ):
        position -= 1
    queue.insert(position, seq_group)
