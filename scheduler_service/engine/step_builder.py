"""The step diff: what the worker needs to hear about one scheduled iteration.

A `StepInput` carries only what changed since the worker last saw each sequence (see
`llmserve.steps`): new sequences whole, known ones as appended tokens and block-table edits,
forks, and frees. The engine hands over the forks and frees as they happen: output
processing's (`add_events`), aborts' and exports' (`add_freed`), and the scheduling
decision's own (`SchedulerOutputs.freed_seq_ids`, read by `build`).
"""

from __future__ import annotations

import time

from llmserve.errors import ApiError
from llmserve.grammar.backend import GrammarError
from llmserve.steps import (
    SAMPLED_TOKEN,
    CachedSequence,
    Fork,
    NewSequence,
    StepInput,
    TableEdit,
    TokenMask,
)
from scheduler_service.engine.grammar import GrammarTimings
from scheduler_service.engine.grammar_requests import grammar_failure
from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs, WorkerEvents
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
# A constrained sequence that samples in a step: (sequence, its group, its chunk, its drafts).
_MaskRow = tuple[Sequence, SequenceGroup, int, list[int]]


class StepBuilder:
    """Builds each step's diff. Per sequence it remembers what the worker holds: how many
    tokens, and how long a block table. In-place table rewrites are read from the block
    manager's dirty marks, so a step costs what changed, not the table sizes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # seq id -> [tokens the worker holds, then the length of each KV group's block table
        # it holds]
        self.views: dict[int, list[int]] = {}
        # Frees held back one step because a fork in the same step copies from that sequence
        # (the worker applies frees before forks).
        self._deferred_frees: list[int] = []
        # Forks and frees handed over since the last step.
        self._forks: list[tuple[Sequence, Sequence, int | None]] = []
        self._freed: list[int] = []
        self._step_id = 0
        # Time spent computing token masks, and how many.
        self.grammar_timings = GrammarTimings()
        # Groups whose grammar failed to compile when their first mask was needed: the
        # engine aborts them before it processes the step (their samples are then ignored).
        self.grammar_failures: list[tuple[SequenceGroup, ApiError]] = []
        # Per step id: its constrained sequences, whose masks `masks` computes after the step
        # is built (and sent).
        self._mask_rows: dict[int, list[_MaskRow]] = {}

    def add_events(self, events: WorkerEvents) -> None:
        """Output processing's forks and frees, for the next step; drafts the worker kept
        are tokens it holds; a skipped update's placeholder is not."""
        self._forks.extend(events.forks)
        self._freed.extend(events.freed_seq_ids)
        views = self.views
        for seq_id, kept in events.kept_drafts:
            views[seq_id][0] += kept
        for seq_id in events.skipped:
            views[seq_id][0] -= 1

    def add_freed(self, seq_ids: list[int]) -> None:
        """Sequences freed between steps (aborted, exported), for the next step."""
        self._freed.extend(seq_ids)

    def has_pending_forks(self) -> bool:
        """Whether forks wait for the next step (a continuation step carries none)."""
        return bool(self._forks)

    def build(self, sched_out: SchedulerOutputs) -> StepInput:
        step = StepInput(
            step_id=self._step_id,
            blocks_to_swap_out=sched_out.blocks_to_swap_out,
            blocks_to_swap_in=sched_out.blocks_to_swap_in,
            states_to_swap_out=sched_out.states_to_swap_out,
            states_to_swap_in=sched_out.states_to_swap_in,
            blocks_to_copy=sched_out.blocks_to_copy,
        )
        self._step_id += 1
        fork_parents = self._add_forks(step)
        self._freed.extend(sched_out.freed_seq_ids)
        self._add_frees(step, fork_parents)
        self._defer_masks(step, self._add_sequences(step, sched_out))
        return step

    def _defer_masks(self, step: StepInput, rows: list[_MaskRow]) -> None:
        """Name the constrained rows whose masks follow the step (`masks`)."""
        if rows:
            step.deferred_mask_seq_ids = [seq.seq_id for seq, *_ in rows]
            self._mask_rows[step.step_id] = rows

    def masks(self, step_id: int) -> tuple[list[TokenMask], float]:
        """The deferred masks of step `step_id` and the seconds they took: one per running row
        (a row that finished meanwhile gets none: its sample is ignored), and one per draft
        row after it for a sequence with drafts (`SequenceGrammar.row_masks`). A row that got
        forced tokens after its continuation step was built samples where the first of them
        already is: its mask allows that token alone, so the worker holds it for the next
        continuation's placeholder, and output processing ignores the sample.
        The first mask of a sequence waits for its grammar to compile (prefill ran meanwhile).
        Safe off the engine's thread while nothing else advances these sequences' grammars."""
        rows = self._mask_rows.pop(step_id, None)
        if not rows:
            return [], 0.0
        start = time.perf_counter()
        masks = []
        for seq, group, chunk, drafts in rows:
            assert seq.grammar is not None
            if seq.status != _RUNNING:
                continue
            sample_at = seq.num_computed_tokens + chunk
            try:
                if drafts:
                    masks.extend(seq.grammar.row_masks(seq.seq_id, drafts))
                    continue
                if sample_at < len(seq.token_ids):
                    masks.append(seq.grammar.only(seq.seq_id, seq.token_ids[sample_at]))
                    continue
                masks.append(seq.grammar.mask(seq.seq_id))
            except GrammarError as exc:
                if all(g is not group for g, _ in self.grammar_failures):
                    self.grammar_failures.append((group, grammar_failure(exc, exc.field)))
        seconds = time.perf_counter() - start
        timings = self.grammar_timings
        timings.last_step_seconds = seconds
        timings.mask_seconds += seconds
        timings.num_masks += len(masks)
        return masks, seconds

    def build_continuation(self, cont: SchedulerOutputs) -> StepInput:
        """The diff of a continuation step (`scheduler_service.engine.pipelined_steps`): each scheduled
        sequence computes the token the step in flight samples for it, named by the
        placeholder `SAMPLED_TOKEN`; the worker will hold one token more than the scheduler
        until that step's result is in. A sequence whose grammar forced tokens after the step
        in flight was built (its chunk is their number) computes them: the placeholder stands
        for the first, which the step in flight samples under a mask allowing it alone. A
        sequence may compute drafts after the placeholder (`cont.drafts`), and one the step in
        flight gave drafts is sent `after_drafts` (`cont.after_drafts`). Groups admitted from
        the waiting queue (`cont.admitted()`) are sent as in a synchronous step."""
        step = StepInput(step_id=self._step_id, blocks_to_copy=cont.blocks_to_copy)
        self._step_id += 1
        self._add_frees(step, self._add_forks(step))
        bm = self.scheduler.block_manager
        tables = bm.block_tables
        views = self.views
        any_dirty = bm.has_dirty_tables()
        several_groups = bm.num_groups > 1
        drafts, after_drafts = cont.drafts, cont.after_drafts
        cached_seqs = step.cached_seqs
        constrained: list[_MaskRow] = []
        for scheduled in cont.continued():
            chunk = scheduled.token_chunk_size
            for seq in scheduled.seq_group.seqs:
                if seq.status is not _RUNNING:
                    continue
                if seq.grammar is not None:
                    # Its mask needs the token the step in flight samples: `masks` runs for
                    # this step once that result is processed (the row then samples at
                    # num_computed_tokens + chunk == len(token_ids)).
                    constrained.append((seq, scheduled.seq_group, chunk, []))
                seq_id = seq.seq_id
                view = views[seq_id]
                known_tokens, known_blocks = view[0], view[1]
                # The worker knows every token and the placeholder sent for the step in
                # flight's input, unless forced tokens came after that input: the first of
                # them is what the step in flight samples (this placeholder), the rest follow.
                if chunk == 1:
                    new_tokens = [SAMPLED_TOKEN]
                    assert len(seq.token_ids) <= known_tokens + 1, (
                        "continued twice without a result"
                    )
                else:
                    forced = seq.token_ids[known_tokens + 1 :]
                    assert len(forced) == chunk - 1, "continued twice without a result"
                    new_tokens = [SAMPLED_TOKEN, *forced]
                table = tables[seq_id]
                offset = known_blocks
                if any_dirty and (dirty := bm.pop_dirty_from(seq_id)) is not None:
                    offset = min(dirty, known_blocks)
                cached = CachedSequence(seq_id, new_tokens, offset, table[offset:], chunk)
                if drafts and (seq_drafts := drafts.get(seq_id)):
                    cached.draft_token_ids = seq_drafts
                    cached.num_scheduled_tokens += len(seq_drafts)
                if after_drafts:
                    cached.after_drafts = seq_id in after_drafts
                if several_groups:
                    cached.group_edits = self._group_edits(seq_id, view)
                cached_seqs.append(cached)
                view[0] = known_tokens + chunk
                view[1] = len(table)
        if cont.num_admitted:
            admitted = SchedulerOutputs(scheduled=cont.admitted())
            constrained += self._add_sequences(step, admitted)
        self._defer_masks(step, constrained)
        return step

    def _add_forks(self, step: StepInput) -> set[int]:
        """Forks since the last step whose child still lives; returns the parents' ids."""
        fork_parents: set[int] = set()
        if not self._forks:
            return fork_parents
        bm = self.scheduler.block_manager
        views = self.views
        forks, self._forks = self._forks, []
        for parent, child, child_slot in forks:
            if not bm.has_table(child):
                continue
            views[child.seq_id] = list(views[parent.seq_id])
            step.forks.append(Fork(parent.seq_id, child.seq_id, child.seq_index, child_slot))
            fork_parents.add(parent.seq_id)
        return fork_parents

    def _add_frees(self, step: StepInput, fork_parents: set[int]) -> None:
        if not (self._freed or self._deferred_frees):
            return
        views = self.views
        freed = self._deferred_frees + self._freed
        self._freed = []
        self._deferred_frees = []
        for seq_id in freed:
            if seq_id in fork_parents:
                self._deferred_frees.append(seq_id)
            elif views.pop(seq_id, None) is not None:
                step.freed_seq_ids.append(seq_id)

    def _add_sequences(self, step: StepInput, sched_out: SchedulerOutputs) -> list[_MaskRow]:
        """A `NewSequence` for each scheduled sequence the worker does not hold, a
        `CachedSequence` (new tokens, table edits) for the others. Runs for every running
        sequence every step, hence the locals. Returns the constrained sequences that sample
        in this step."""
        bm = self.scheduler.block_manager
        tables = bm.block_tables
        pop_dirty_from = bm.pop_dirty_from
        any_dirty = bm.has_dirty_tables()
        grouped = bm.num_groups > 1
        views = self.views
        cached_seqs = step.cached_seqs
        drafts = sched_out.drafts
        constrained: list[_MaskRow] = []
        saves_states = bm.states is not None and bm.enable_caching
        for scheduled in sched_out.scheduled:
            seq_group = scheduled.seq_group
            chunk = scheduled.token_chunk_size
            for seq in seq_group.seqs:
                if seq.status != _RUNNING:
                    continue
                if seq.grammar is not None and seq.num_computed_tokens + chunk == seq.get_len():
                    constrained.append((seq, seq_group, chunk, drafts.get(seq.seq_id, [])))
                seq_id = seq.seq_id
                # With drafts the state after the step is not known here: no snapshot.
                if (
                    saves_states
                    and seq.seq_id not in drafts
                    and (save := bm.save_state(seq, chunk)) is not None
                ):
                    step.state_saves.append(save)
                table = tables[seq_id]
                tokens = seq.token_ids
                view = views.get(seq_id)
                if view is None:
                    new = self._new_seq(seq, seq_group, table, chunk, bm.state_slot(seq_id))
                    new.state_from_slot = bm.pop_state_source(seq)
                    views[seq_id] = [len(tokens), len(table)]
                    if any_dirty:
                        pop_dirty_from(seq_id)
                    if grouped:
                        new.group_block_ids = self._group_tables(seq_id, views[seq_id])
                    step.new_seqs.append(new)
                    continue
                known_tokens, known_blocks = view[0], view[1]
                dirty = pop_dirty_from(seq_id) if any_dirty else None
                offset = known_blocks if dirty is None or dirty > known_blocks else dirty
                cached = CachedSequence(
                    seq_id=seq_id,
                    new_token_ids=tokens[known_tokens:],
                    block_offset=offset,
                    block_ids=table[offset:],
                    num_scheduled_tokens=chunk,
                )
                if drafts and (seq_drafts := drafts.get(seq_id)):
                    cached.draft_token_ids = seq_drafts
                    cached.num_scheduled_tokens += len(seq_drafts)
                if grouped:
                    cached.group_edits = self._group_edits(seq_id, view)
                cached_seqs.append(cached)
                view[0] = len(tokens)
                view[1] = len(table)
        return constrained

    def _group_tables(self, seq_id: int, view: list[int]) -> list[list[int]]:
        """The whole tables of KV groups 1.. for a new sequence; extends its view."""
        bm = self.scheduler.block_manager
        tables = []
        for g in range(1, bm.num_groups):
            table = bm.group_tables[g][seq_id]
            bm.pop_dirty_from(seq_id, g)
            tables.append(list(table))
            view.append(len(table))
        return tables

    def _group_edits(self, seq_id: int, view: list[int]) -> list[TableEdit]:
        """What changed in the tables of KV groups 1.. since the worker last saw them (the
        view's entries 2.. are their lengths then); updates the view."""
        bm = self.scheduler.block_manager
        edits = []
        for g in range(1, bm.num_groups):
            table = bm.group_tables[g][seq_id]
            known = view[g + 1]
            dirty = bm.pop_dirty_from(seq_id, g)
            offset = known if dirty is None or dirty > known else dirty
            edits.append(TableEdit(offset, table[offset:]))
            view[g + 1] = len(table)
        return edits

    @staticmethod
    def _new_seq(
        seq: Sequence,
        seq_group: SequenceGroup,
        table: list[int],
        chunk: int,
        state_slot: int | None,
    ) -> NewSequence:
        return NewSequence(
            seq_id=seq.seq_id,
            request_id=seq_group.request_id,
            seq_index=seq.seq_index,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            block_ids=list(table),
            num_scheduled_tokens=chunk,
            sampling_params=seq_group.sampling_params,
            state_slot=state_slot,
        )
