"""The iteration scheduler: which sequences run next, and where their blocks go.

`schedule()` is a short sequence of stages. With chunked prefill (the default):

  1. `_schedule_running`: decodes of running groups first, preempting the latest-arrived
     groups when blocks run out; then the next chunks of partially prefilled prompts.
  2. `_schedule_swapped`: swapped groups come back, oldest first (skipped after a preemption).
  3. `_schedule_waiting`: new prompts, FCFS, while blocks and budgets last (skipped after a
     preemption or while any group is still swapped out).

Without chunked prefill (the prefill-first policy) an iteration runs either whole prompts
(stage 3 alone, when it admits anything) or the decode stages 1 and 2.
"""

from __future__ import annotations

import time
from collections import deque

from scheduler_service.block_manager import AllocStatus, BlockSpaceManager
from scheduler_service.config import CacheConfig, PreemptionMode, SchedulerConfig
from scheduler_service.policy import SchedulingBudget, insert_by_arrival, preemption_mode
from scheduler_service.scheduler_outputs import (
    PreemptedGroup,
    ScheduledGroup,
    SchedulerOutputs,
    SchedulerStats,
)
from scheduler_service.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "PreemptedGroup",
    "ScheduledGroup",
    "Scheduler",
    "SchedulerOutputs",
    "SchedulerStats",
]

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
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
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self._groups: dict[str, SequenceGroup] = {}
        # Worker-visible events since the engine last drained them.
        self.freed_seq_ids: list[int] = []
        self.forks: list[tuple[Sequence, Sequence]] = []
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        self.num_ignored = 0
        self._num_steps = 0

    # -- requests -------------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup, by_arrival: bool = False) -> None:
        """Queue a group last, or (`by_arrival`, for a group moved here) after the waiting
        groups that arrived before it."""
        assert seq_group.request_id not in self._groups, "duplicate request id"
        self._groups[seq_group.request_id] = seq_group
        if by_arrival:
            insert_by_arrival(self.waiting, seq_group)
        else:
            self.waiting.append(seq_group)

    def get_seq_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Finish every sequence of the request as ABORTED and free its blocks."""
        seq_group = self._groups.pop(request_id, None)
        if seq_group is None:
            return None
        for queue in (self.waiting, self.running, self.swapped):
            if seq_group in queue:
                queue.remove(seq_group)
                break
        for seq in seq_group.get_unfinished_seqs():
            seq.status = SequenceStatus.ABORTED
            self.free_seq(seq)
        self.forks = [f for f in self.forks if f[1].status < SequenceStatus.STOPPED]
        return seq_group

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def unfinished_request_ids(self) -> list[str]:
        return [g.request_id for q in (self.waiting, self.running, self.swapped) for g in q]

    # -- called by output processing ------------------------------------------------------

    def free_seq(self, seq: Sequence) -> None:
        if self.block_manager.has_table(seq):
            self.block_manager.free(seq)
            self.freed_seq_ids.append(seq.seq_id)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)
        self.forks.append((parent, child))

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
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            gpu_kv_usage=bm.gpu_usage(),
            cpu_kv_usage=bm.cpu_usage(),
            num_preemptions_recompute=self.num_preemptions[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=self.num_preemptions[PreemptionMode.SWAP],
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_ignored=self.num_ignored,
        )

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutputs:
        self._num_steps += 1
        self.block_manager.now = float(self._num_steps)
        config = self.scheduler_config
        budget = SchedulingBudget(config.max_num_batched_tokens, config.max_num_seqs)
        out = SchedulerOutputs()
        if not config.enable_chunked_prefill and not self.swapped:
            # Running groups sit this step out but keep their places: prompts are admitted
            # only into the room they leave under max_num_seqs (as in the seed's step 1).
            budget.num_seqs = sum(g.get_max_num_running_seqs() for g in self.running)
            self._schedule_waiting(budget, out)
            if out.scheduled or out.ignored:
                return self._finish(out, budget)
            budget.num_seqs = 0  # the running stage counts the running groups itself
        self._schedule_running(budget, out)
        if not out.preempted:
            self._schedule_swapped(budget, out)
        if config.enable_chunked_prefill and not out.preempted and not self.swapped:
            self._schedule_waiting(budget, out)
        return self._finish(out, budget)

    def _finish(self, out: SchedulerOutputs, budget: SchedulingBudget) -> SchedulerOutputs:
        out.num_batched_tokens = budget.num_tokens
        return out

    def _schedule(
        self, seq_group: SequenceGroup, chunk: int, budget: SchedulingBudget, out: SchedulerOutputs
    ) -> None:
        num_seqs = 0
        copies = out.blocks_to_copy
        append_slots = self.block_manager.append_slots
        for seq in seq_group.seqs:
            if seq.status == _RUNNING:
                num_seqs += 1
                append_slots(seq, copies)
        budget.num_tokens += chunk * num_seqs
        out.scheduled.append(ScheduledGroup(seq_group, chunk))

    def _schedule_running(self, budget: SchedulingBudget, out: SchedulerOutputs) -> None:
        running = list(self.running)
        prefills, preempted = self._schedule_decodes(running, budget, out)
        preempted |= self._schedule_prefill_chunks(prefills, budget, out)
        if preempted:
            self.running = deque(g for g in running if g.request_id not in preempted)
            budget.num_seqs = sum(g.get_max_num_running_seqs() for g in self.running)

    def _schedule_decodes(
        self, running: list[SequenceGroup], budget: SchedulingBudget, out: SchedulerOutputs
    ) -> tuple[list[SequenceGroup], set[str]]:
        """One token for each running group past its prompt, in arrival order; when blocks run
        out, the latest-arrived groups not yet visited are preempted (last of all the group
        itself). Returns the groups still prefilling and the preempted request ids.

        This loop runs for every running group every step, so it keeps the budget in locals
        and skips the group-level helpers that `_schedule` goes through.
        """
        bm = self.block_manager
        can_append = bm.can_append_slots
        append_slots = bm.append_slots
        copies = out.blocks_to_copy
        scheduled = out.scheduled
        prefills: list[SequenceGroup] = []
        preempted: set[str] = set()
        max_tokens = budget.max_tokens
        num_tokens = budget.num_tokens
        num_seqs = budget.num_seqs
        # running[i:end] are the groups not visited yet; victims are taken from the end.
        i, end = 0, len(running)
        while i < end:
            seq_group = running[i]
            i += 1
            num_seqs += seq_group.get_max_num_running_seqs()
            num_running = uncomputed = 0
            for seq in seq_group.seqs:
                if seq.status == _RUNNING:
                    num_running += 1
                    uncomputed += len(seq.token_ids) - seq.num_computed_tokens
            if uncomputed > num_running:
                prefills.append(seq_group)
                continue
            if uncomputed > max_tokens - num_tokens:
                continue
            while not can_append(seq_group):
                if i < end:
                    end -= 1
                    victim = running[end]
                else:
                    victim = seq_group
                self._preempt(victim, out)
                preempted.add(victim.request_id)
                if victim is seq_group:
                    break
            else:
                for seq in seq_group.seqs:
                    if seq.status == _RUNNING:
                        append_slots(seq, copies)
                num_tokens += num_running
                scheduled.append(ScheduledGroup(seq_group, 1))
        budget.num_tokens = num_tokens
        budget.num_seqs = num_seqs
        return prefills, preempted

    def _schedule_prefill_chunks(
        self, prefills: list[SequenceGroup], budget: SchedulingBudget, out: SchedulerOutputs
    ) -> set[str]:
        """The next chunk of each partially prefilled prompt, while the token budget lasts.
        Returns the request ids preempted for want of blocks."""
        can_append = self.block_manager.can_append_slots
        preempted: set[str] = set()
        for seq_group in prefills:
            seqs = seq_group.get_seqs(_RUNNING)
            seq = seqs[0]  # siblings are equally long and equally computed
            chunk = min(
                seq.get_len() - seq.num_computed_tokens, budget.remaining_tokens // len(seqs)
            )
            if chunk <= 0:
                continue
            if not can_append(seq_group):
                self._preempt(seq_group, out)
                preempted.add(seq_group.request_id)
                continue
            self._schedule(seq_group, chunk, budget, out)
        return preempted

    def _schedule_swapped(self, budget: SchedulingBudget, out: SchedulerOutputs) -> None:
        bm = self.block_manager
        while self.swapped:
            seq_group = self.swapped[0]
            if not bm.can_swap_in(seq_group):
                break
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if budget.num_seqs + num_new_seqs > budget.max_seqs:
                break
            seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
            # Siblings are always equally long and equally computed.
            uncomputed = seqs[0].get_len() - seqs[0].num_computed_tokens
            if uncomputed > 1:  # swapped out mid-prefill
                chunk = min(uncomputed, budget.remaining_tokens // len(seqs))
                if chunk <= 0:
                    break
            else:
                chunk = 1
                if len(seqs) > budget.remaining_tokens:
                    break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(seq_group).items())
            for seq in seqs:
                seq.status = _RUNNING
            budget.num_seqs += num_new_seqs
            insert_by_arrival(self.running, seq_group)
            self._schedule(seq_group, chunk, budget, out)

    def _schedule_waiting(self, budget: SchedulingBudget, out: SchedulerOutputs) -> None:
        config = self.scheduler_config
        bm = self.block_manager
        chunked = config.enable_chunked_prefill
        now: float | None = None
        while self.waiting:
            seq_group = self.waiting[0]
            # One sequence, or (a group preempted by recompute or moved from another replica)
            # several siblings of equal length that share the prompt's blocks.
            seqs = seq_group.get_seqs(SequenceStatus.WAITING)
            seq = seqs[0]
            num_tokens = seq.get_len()
            if num_tokens > config.model_len:
                self._ignore(
                    seq_group,
                    f"prompt has {num_tokens} tokens, more than max_model_len "
                    f"({config.model_len})",
                    out,
                )
                continue
            can_allocate = bm.can_allocate(seq_group)
            if can_allocate is AllocStatus.LATER:
                break
            if can_allocate is AllocStatus.NEVER:
                self._ignore(
                    seq_group,
                    f"prompt needs {seq.get_num_logical_blocks()} KV blocks, more than the "
                    f"cache can ever hold ({bm.num_total_gpu_blocks} blocks, watermark "
                    f"{bm.watermark_blocks})",
                    out,
                )
                continue
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if budget.num_seqs + num_new_seqs > budget.max_seqs:
                break
            share = budget.remaining_tokens // len(seqs)
            # Without chunking a prompt runs whole; siblings that together exceed the token
            # budget run alone in a step (they fit the budget one by one).
            if share <= 0 or (not chunked and num_tokens > share and budget.num_tokens > 0):
                break
            self.waiting.popleft()
            bm.allocate(seq_group)
            computed = 0
            if seq_group.sampling_params.prompt_logprobs is None:
                # Prompt logprobs need every prompt position computed, so no cache reuse.
                computed = min(bm.get_num_computed_tokens(s) for s in seqs)
            for s in seqs:
                s.num_computed_tokens = computed
                s.status = _RUNNING
            chunk = num_tokens - computed
            if chunked:
                chunk = min(chunk, share)
            budget.num_seqs += num_new_seqs
            insert_by_arrival(self.running, seq_group)
            self._schedule(seq_group, chunk, budget, out)
            # Running and swapped groups went through here first, so only admissions are new.
            if seq_group.metrics.first_scheduled_time is None:
                now = now or time.monotonic()
                seq_group.metrics.first_scheduled_time = now

    def _ignore(self, seq_group: SequenceGroup, reason: str, out: SchedulerOutputs) -> None:
        self.waiting.popleft()
        for seq in seq_group.seqs:
            seq.status = SequenceStatus.IGNORED
            self.free_seq(seq)
        seq_group.ignore_reason = reason
        self._groups.pop(seq_group.request_id, None)
        self.num_ignored += 1
        out.ignored.append(seq_group)

    # -- preemption -------------------------------------------------------------------------

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        mode = preemption_mode(self.scheduler_config.preemption_mode, seq_group)
        if mode is PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            mode = PreemptionMode.RECOMPUTE  # no host swap space left: recompute instead
        if mode is PreemptionMode.RECOMPUTE:
            for seq in seq_group.get_seqs(_RUNNING):
                self.free_seq(seq)
                seq.reset_for_recompute()
            self.waiting.appendleft(seq_group)
        else:
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq_group).items())
            for seq in seq_group.get_seqs(_RUNNING):
                seq.status = SequenceStatus.SWAPPED
            insert_by_arrival(self.swapped, seq_group, ahead_of_ties=True)
        self.num_preemptions[mode] += 1
        out.preempted.append(PreemptedGroup(seq_group.request_id, mode))
