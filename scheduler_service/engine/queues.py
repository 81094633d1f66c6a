"""A replica's queues, its groups and its block manager: the state the scheduler decides over.

`SchedulerQueues` keeps the waiting, running and swapped groups (each in (priority, arrival)
order), adds and aborts requests, frees and forks sequences' blocks for output processing, and
reports statistics. The decisions (what runs next, what is preempted) are `Scheduler`'s
(scheduler.py).
"""

from __future__ import annotations

from collections import deque

from scheduler_service.engine.block_manager import BlockSpaceManager
from scheduler_service.engine.config import CacheConfig, PreemptionMode, SchedulerConfig
from scheduler_service.engine.policy import insert_in_order
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs, SchedulerStats
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.engine.speculation import Speculator

_RUNNING = SequenceStatus.RUNNING


class SchedulerQueues:
    """One replica's queues and block manager. Not thread-safe: one loop drives it."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockSpaceManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks,
            watermark=cache_config.watermark,
            enable_caching=cache_config.enable_prefix_caching,
            windows=cache_config.kv_windows,
            num_state_slots=cache_config.num_state_slots,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self._groups: dict[str, SequenceGroup] = {}
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        self.num_ignored = 0
        self._num_steps = 0
        # Requests added or aborted so far (see `state_stamp`).
        self._num_changes = 0
        self.speculator = Speculator(scheduler_config, self.block_manager)

    # -- requests -------------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """Queue a group among the waiting ones, in (priority, arrival) order."""
        assert seq_group.request_id not in self._groups, "duplicate request id"
        self._groups[seq_group.request_id] = seq_group
        insert_in_order(self.waiting, seq_group)
        self._num_changes += 1

    def get_seq_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def abort_seq_group(
        self, request_id: str, freed: list[int] | None = None
    ) -> SequenceGroup | None:
        """Finish every sequence of the request as ABORTED and free its blocks (adding the
        freed sequences' ids to `freed`)."""
        seq_group = self._groups.pop(request_id, None)
        if seq_group is None:
            return None
        self._num_changes += 1
        for queue in (self.waiting, self.running, self.swapped):
            if seq_group in queue:
                queue.remove(seq_group)
                break
        freed = [] if freed is None else freed
        for seq in seq_group.get_unfinished_seqs():
            seq.status = SequenceStatus.ABORTED
            self.free_seq(seq, freed)
        return seq_group

    @property
    def state_stamp(self) -> tuple[int, int]:
        """Changes whenever a step is scheduled or a request is added or aborted: what a
        figure computed over the queues (routing's load) may be kept for until then."""
        return self._num_steps, self._num_changes

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def unfinished_request_ids(self) -> list[str]:
        return [g.request_id for q in (self.waiting, self.running, self.swapped) for g in q]

    # -- called by output processing ------------------------------------------------------

    def free_seq(self, seq: Sequence, freed: list[int]) -> None:
        """Free the sequence's blocks, if it holds any, and add its id to `freed`."""
        if self.block_manager.has_table(seq):
            self.block_manager.free(seq)
            freed.append(seq.seq_id)

    def fork_seq(
        self,
        parent: Sequence,
        child: Sequence,
        forks: list[tuple[Sequence, Sequence, int | None]],
    ) -> None:
        """Share the parent's blocks with the child, and add the pair and the child's state
        slot to `forks`."""
        bm = self.block_manager
        bm.fork(parent, child)
        forks.append((parent, child, bm.state_slot(child.seq_id)))

    def free_finished_seq_groups(self, finished: list[SequenceGroup]) -> None:
        """Forget the groups that finished this step and drop them from `running` (output
        processing has freed their sequences' blocks)."""
        if not finished:
            return
        done: set[str] = set()
        for seq_group in finished:
            self._groups.pop(seq_group.request_id, None)
            done.add(seq_group.request_id)
        self.running = deque(g for g in self.running if g.request_id not in done)

    def on_step_executed(self, outputs: SchedulerOutputs) -> None:
        """Advance the computed-token counts of the scheduled sequences."""
        mark_computed = self.block_manager.mark_computed
        for scheduled in outputs.scheduled:
            chunk = scheduled.token_chunk_size
            for seq in scheduled.seq_group.seqs:
                if seq.status == _RUNNING:
                    seq.num_computed_tokens += chunk
                    mark_computed(seq)

    def get_stats(self) -> SchedulerStats:
        bm = self.block_manager
        spec = self.speculator.stats
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            gpu_kv_usage=bm.gpu_usage(),
            cpu_kv_usage=bm.cpu_usage(),
            num_preemptions_recompute=self.num_preemptions[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=self.num_preemptions[PreemptionMode.SWAP],
            prefix_cache_queries=bm.prefix.queries,
            prefix_cache_hits=bm.prefix.hits,
            num_ignored=self.num_ignored,
            num_waiting_prefill_tokens=sum(
                g.seqs[0].get_len() - g.seqs[0].num_computed_tokens for g in self.waiting
            ),
            num_spec_drafts=spec.num_drafts,
            num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            num_spec_after_drafts=spec.num_after_drafts,
            num_spec_after_drafts_dropped=spec.num_after_drafts_dropped,
            kv_group_usage=tuple(
                used / max(bm.num_total_gpu_blocks - bm.num_reserved, 1)
                for used in bm.group_usage()
            ),
        )
