"""The iteration scheduler: which sequences run next, and where their blocks go.

Every queue is kept in (priority, arrival) order: lower priority values first (vLLM's
convention, default 0), then earlier arrivals (`policy.insert_in_order`). `schedule()` is a
short sequence of stages. With chunked prefill (the default):

  0. `_preempt_for_priority`: a waiting group that cannot be admitted takes the place of
     running groups of lower priority (the last ones).
  1. `_schedule_running`: decodes of running groups first, preempting the last groups (lowest
     priority, latest arrival) when blocks run out; then the next chunks of partially
     prefilled prompts.
  2. `_schedule_swapped`: swapped groups come back in order (skipped after a preemption in
     stage 1, and stopped at a group of lower priority than the first waiting one).
  3. `_schedule_waiting`: new prompts in order, while blocks and budgets last (skipped after a
     preemption in stage 1, or while a group of equal or higher priority is swapped out).

Without chunked prefill (the prefill-first policy) an iteration runs either whole prompts
(stage 3 alone, after stage 0, when it admits anything) or the decode stages 1 and 2.
"""

from __future__ import annotations

import time
from collections import deque

from llmserve.errors import FieldError
from llmserve.limits import prompt_too_long
from scheduler_service.engine.block_manager import AllocStatus
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.policy import SchedulingBudget, insert_in_order, preemption_mode
from scheduler_service.engine.queues import SchedulerQueues
from scheduler_service.engine.scheduler_outputs import (
    PreemptedGroup,
    ScheduledGroup,
    SchedulerOutputs,
    SchedulerStats,
)
from scheduler_service.engine.sequence import SequenceGroup, SequenceStatus

__all__ = [
    "PreemptedGroup",
    "ScheduledGroup",
    "Scheduler",
    "SchedulerOutputs",
    "SchedulerStats",
]

_RUNNING = SequenceStatus.RUNNING


class Scheduler(SchedulerQueues):
    """One replica's scheduling decisions over its queues (`SchedulerQueues`). Not
    thread-safe: one loop drives it."""

    # -- scheduling -------------------------------------------------------------------------

    def advance_clock(self) -> None:
        """One more step: the block manager's LRU clock moves on."""
        self._num_steps += 1
        self.block_manager.now = float(self._num_steps)

    def schedule(self) -> SchedulerOutputs:
        self.advance_clock()
        config = self.scheduler_config
        budget = SchedulingBudget(config.token_budget, config.max_num_seqs)
        out = SchedulerOutputs()
        self._preempt_for_priority(out)
        if not config.enable_chunked_prefill and self._may_admit():
            # Running groups sit this step out but keep their places: prompts are admitted
            # only into the room they leave under max_num_seqs (as in the seed's step 1).
            budget.num_seqs = sum(g.get_max_num_running_seqs() for g in self.running)
            self._schedule_waiting(budget, out)
            if out.scheduled or out.ignored:
                return self._finish(out, budget)
            budget.num_seqs = 0  # the running stage counts the running groups itself
        num_preempted = len(out.preempted)
        self._schedule_running(budget, out)
        preempted = len(out.preempted) > num_preempted
        if not preempted:
            self._schedule_swapped(budget, out)
        if config.enable_chunked_prefill and not preempted and self._may_admit():
            self._schedule_waiting(budget, out)
        return self._finish(out, budget)

    def can_admit_ahead(self) -> bool:
        """Whether a continuation step (pipelined_steps.py) may admit waiting groups: only
        where a synchronous `schedule()` would admit them the same way, with chunked prefill
        (without it, running groups sit out a step that admits), nothing swapped out, and no
        waiting group that `_preempt_for_priority` could make room for."""
        waiting, running = self.waiting, self.running
        return (
            self.scheduler_config.enable_chunked_prefill
            and not self.swapped
            and not (waiting and running and running[-1].priority > waiting[0].priority)
        )

    def admit_ahead(self, out: SchedulerOutputs) -> None:
        """Admit waiting groups into the continuation step `out`, within the token and
        sequence budgets it leaves (every running group counts, finishing ones too). A group
        that would be ignored stops the admissions: the next synchronous step reports it."""
        config = self.scheduler_config
        budget = SchedulingBudget(
            config.token_budget,
            config.max_num_seqs,
            num_tokens=out.num_batched_tokens,
            num_seqs=sum(g.get_max_num_running_seqs() for g in self.running),
        )
        self._schedule_waiting(budget, out, may_ignore=False)
        out.num_batched_tokens = budget.num_tokens

    def _may_admit(self) -> bool:
        """Swapped groups come back before new prompts are admitted, unless the first waiting
        group has a higher priority than every swapped one."""
        swapped = self.swapped
        return not swapped or bool(self.waiting and self.waiting[0].priority < swapped[0].priority)

    def _preempt_for_priority(self, out: SchedulerOutputs) -> None:
        """While the first waiting group cannot be admitted (no blocks, or no room under
        `max_num_seqs`), preempt the last running group if its priority is lower: the latest
        arrival of the lowest priority goes first, and equal or higher priorities never go for
        it. Costs nothing while the last running group's priority is not lower."""
        waiting, running = self.waiting, self.running
        if not waiting or not running or running[-1].priority <= waiting[0].priority:
            return
        head = waiting[0]
        if head.get_seqs(SequenceStatus.WAITING)[0].get_len() > self.scheduler_config.model_len:
            return  # it will be ignored, not admitted
        bm = self.block_manager
        max_seqs = self.scheduler_config.max_num_seqs
        needed = head.get_max_num_running_seqs()
        num_seqs = sum(g.get_max_num_running_seqs() for g in running)
        first_step = self.scheduler_config.token_budget
        while running and running[-1].priority > head.priority:
            can_allocate = bm.can_allocate(head, first_step)
            if can_allocate is AllocStatus.NEVER:
                return
            if can_allocate is AllocStatus.OK and num_seqs + needed <= max_seqs:
                return
            victim = running.pop()
            num_seqs -= victim.get_max_num_running_seqs()
            self._preempt(victim, out)

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
                append_slots(seq, copies, chunk)
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
        token_budget = budget.token_budget
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
            if uncomputed > token_budget - num_tokens:
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
        bm = self.block_manager
        preempted: set[str] = set()
        for seq_group in prefills:
            seqs = seq_group.get_seqs(_RUNNING)
            seq = seqs[0]  # siblings are equally long and equally computed
            chunk = min(
                seq.get_len() - seq.num_computed_tokens, budget.remaining_tokens // len(seqs)
            )
            if chunk <= 0:
                continue
            chunk = bm.state_chunk(seq, chunk)
            # A windowed group's next blocks grow with the chunk: a shorter one may fit.
            chunk = bm.max_append_chunk(seq_group, chunk)
            if chunk == 0:
                self._preempt(seq_group, out)
                preempted.add(seq_group.request_id)
                continue
            self._schedule(seq_group, chunk, budget, out)
        return preempted

    def _schedule_swapped(self, budget: SchedulingBudget, out: SchedulerOutputs) -> None:
        bm = self.block_manager
        while self.swapped:
            seq_group = self.swapped[0]
            if self.waiting and self.waiting[0].priority < seq_group.priority:
                break  # the blocks go to the waiting group of higher priority first
            if not bm.can_swap_in(seq_group):
                if not bm.can_ever_swap_in(seq_group):
                    self._recompute_swapped(seq_group, out)
                    continue
                break
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if budget.num_seqs + num_new_seqs > budget.seq_budget:
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
            out.blocks_to_swap_in.extend(bm.swap_in(seq_group, out.states_to_swap_in).items())
            for seq in seqs:
                seq.status = _RUNNING
            budget.num_seqs += num_new_seqs
            insert_in_order(self.running, seq_group)
            self._schedule(seq_group, chunk, budget, out)

    def _recompute_swapped(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """A swapped group that grew past what the whole cache holds at once goes back to
        the waiting queue to be recomputed (its host blocks freed)."""
        self.swapped.popleft()
        for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
            self.free_seq(seq, out.freed_seq_ids)
            seq.reset_for_recompute()
        insert_in_order(self.waiting, seq_group, ahead_of_ties=True)
        self.num_preemptions[PreemptionMode.RECOMPUTE] += 1
        out.preempted.append(PreemptedGroup(seq_group.request_id, PreemptionMode.RECOMPUTE))

    def _schedule_waiting(
        self, budget: SchedulingBudget, out: SchedulerOutputs, may_ignore: bool = True
    ) -> None:
        """New prompts in order while blocks and budgets last; one that can never run is
        ignored (`may_ignore`) or ends the admissions."""
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
            too_long = prompt_too_long(num_tokens, config.model_len)
            if too_long is not None:
                if not may_ignore:
                    break
                self._ignore(seq_group, too_long, out)
                continue
            share = budget.remaining_tokens // len(seqs)
            can_allocate = bm.can_allocate(seq_group, share if chunked else None)
            if can_allocate is AllocStatus.NEVER:
                if not may_ignore:
                    break
                self._ignore(seq_group, bm.never_reason(seq_group), out)
                continue
            if can_allocate is AllocStatus.LATER:
                # A first step shorter than the share may fit (a windowed group's blocks
                # grow with it).
                if not chunked or bm.max_chunk(seqs, share) >= share:
                    break
                share = bm.max_chunk(seqs, share)
                if bm.can_allocate(seq_group, share) is not AllocStatus.OK:
                    break
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if budget.num_seqs + num_new_seqs > budget.seq_budget:
                break
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
            if chunked:  # ending at the prompt's last block boundary keeps the state there
                chunk = bm.state_chunk(seq, min(chunk, share))
            budget.num_seqs += num_new_seqs
            insert_in_order(self.running, seq_group)
            self._schedule(seq_group, chunk, budget, out)
            # Running and swapped groups went through here first, so only admissions are new.
            if seq_group.metrics.first_scheduled_time is None:
                now = now or time.monotonic()
                seq_group.metrics.first_scheduled_time = now

    def _ignore(self, seq_group: SequenceGroup, reason: str, out: SchedulerOutputs) -> None:
        self.waiting.popleft()
        for seq in seq_group.seqs:
            seq.status = SequenceStatus.IGNORED
            self.free_seq(seq, out.freed_seq_ids)
        seq_group.error = FieldError("prompt", reason)
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
                self.free_seq(seq, out.freed_seq_ids)
                seq.reset_for_recompute()
            insert_in_order(self.waiting, seq_group, ahead_of_ties=True)
        else:
            moved = self.block_manager.swap_out(seq_group, out.states_to_swap_out)
            out.blocks_to_swap_out.extend(moved.items())
            for seq in seq_group.get_seqs(_RUNNING):
                seq.status = SequenceStatus.SWAPPED
            insert_in_order(self.swapped, seq_group, ahead_of_ties=True)
        self.num_preemptions[mode] += 1
        out.preempted.append(PreemptedGroup(seq_group.request_id, mode))
