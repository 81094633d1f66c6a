"""Scheduling policy: the per-step budget, and how a group is preempted.

Decisions only; the `Scheduler` moves groups between its queues and the block manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.config import PreemptionMode
from scheduler_service.sequence import SequenceGroup


class SwapSpaceExhaustedError(RuntimeError):
    """A multi-sequence group had to be preempted but the host swap space is full."""


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
    """RECOMPUTE for a group with one live sequence, SWAP otherwise, unless `forced` says so.

    Forcing RECOMPUTE on a group with several live sequences still swaps: their shared blocks
    cannot be recomputed as one prompt.
    """
    num_live = len(seq_group.get_unfinished_seqs())
    if forced is PreemptionMode.RECOMPUTE and num_live == 1:
        return PreemptionMode.RECOMPUTE
    if forced is PreemptionMode.SWAP:
        return PreemptionMode.SWAP
    if seq_group.get_max_num_running_seqs() == 1:
        return PreemptionMode.RECOMPUTE
    return PreemptionMode.SWAP
