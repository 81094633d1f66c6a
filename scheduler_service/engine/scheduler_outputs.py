"""What one `Scheduler.schedule()` decided, and the scheduler's counters for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledGroup:
    seq_group: SequenceGroup
    # Tokens each running sequence of the group computes this step: 1 for a decode, the
    # chunk length for a (single-sequence) prefill.
    token_chunk_size: int


@dataclass(slots=True)
class PreemptedGroup:
    request_id: str
    mode: PreemptionMode


@dataclass(slots=True)
class SchedulerOutputs:
    scheduled: list[ScheduledGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Recurrent layers' states moved with swapped blocks: (host slot, device slot) in,
    # (device slot, host slot) out.
    states_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    states_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # Finished as IGNORED this step (never ran); `seq_group.error` says why.
    ignored: list[SequenceGroup] = field(default_factory=list)
    preempted: list[PreemptedGroup] = field(default_factory=list)
    # Sequences whose blocks this step's scheduling freed (preempted by recompute, ignored).
    freed_seq_ids: list[int] = field(default_factory=list)
    # Built by asynchronous scheduling before the previous step's result was back
    # (scheduler_service/engine/pipelined_steps.py).
    is_continuation: bool = False
    # Speculative decoding: seq id -> the draft tokens it computes after its last token
    # (scheduler_service/engine/speculation.py); empty in most steps.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # A continuation's sequences that the step in flight gave drafts: their updates assume
    # every draft is kept (`CachedSequence.after_drafts`). One that keeps fewer leaves this
    # step when that result is processed (`drop`): the worker skips it.
    after_drafts: set[int] = field(default_factory=set)
    # A continuation's last `num_admitted` groups came from the waiting queue as it was built
    # (`Scheduler.admit_ahead`): they start their prompts instead of continuing.
    num_admitted: int = 0

    def continued(self) -> list[ScheduledGroup]:
        """A continuation's groups that compute what the step in flight samples."""
        return self.scheduled[: len(self.scheduled) - self.num_admitted]

    def admitted(self) -> list[ScheduledGroup]:
        """A continuation's groups admitted from the waiting queue (`num_admitted`)."""
        return self.scheduled[len(self.scheduled) - self.num_admitted :]

    def drop(self, seq_group: SequenceGroup) -> None:
        """Take a group out of the step (a continuation whose assumption failed)."""
        seq_id = seq_group.seqs[0].seq_id
        self.scheduled = [s for s in self.scheduled if s.seq_group is not seq_group]
        self.num_batched_tokens -= 1 + len(self.drafts.pop(seq_id, ()))
        self.after_drafts.discard(seq_id)

    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


@dataclass(slots=True)
class WorkerEvents:
    """What output processing did that the worker must hear of in the next step (sequences
    forked (parent, child, the child's state slot), sequences whose blocks were freed), or
    already knows (drafts it kept)."""

    # The slot is the one the child got at the fork: the step that carries the fork may swap
    # the child out before it is built (the worker forks before it swaps).
    forks: list[tuple[Sequence, Sequence, int | None]] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    # (seq id, drafts kept) of the running sequences that verified drafts: the worker holds
    # the kept ones as known tokens now.
    kept_drafts: list[tuple[int, int]] = field(default_factory=list)
    # Sequences dropped from the continuation in flight (`SchedulerOutputs.drop`): the worker
    # skips their update, so it holds one token fewer than the update sent.
    skipped: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for metrics and traces. Counters are cumulative since start."""

    num_waiting: int
    num_running: int
    num_swapped: int
    gpu_kv_usage: float
    cpu_kv_usage: float
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # of those, found already computed
    num_ignored: int
    # Tokens the waiting requests still have to prefill (their prompts, or prompts and
    # outputs after a recompute preemption or a move).
    num_waiting_prefill_tokens: int = 0
    # Speculative decoding (scheduler_service/engine/speculation.py): sequence-steps with drafts,
    # draft tokens, drafts kept, and per draft position how often it was kept.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Updates sent assuming the step in flight keeps its drafts, and those dropped.
    num_spec_after_drafts: int = 0
    num_spec_after_drafts_dropped: int = 0
    # Per KV group (`llmserve.kv_layout`), the fraction of the usable device blocks it holds.
    kv_group_usage: tuple[float, ...] = ()
