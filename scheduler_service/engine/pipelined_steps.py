"""Asynchronous scheduling: the next step, decided before the previous step's result is back.

While step N runs on the worker, the engine can build step N+1 as a *continuation*: every
sequence that samples in N computes one more token, the one N samples, which the step names
with the placeholder `llmserve.steps.SAMPLED_TOKEN` (the worker fills it in). The KV slot for
that token is reserved now (`BlockSpaceManager.reserve_lookahead`); the token itself is
appended when N's result arrives, as in synchronous scheduling.

Only a step whose outcome cannot change what N+1 schedules is continued
(`plan_continuation`): nothing swapped (swaps and preemptions happen only at synchronous
steps), every running group scheduled in N and sampling there, no beam search and no fork at
a first sample, and free blocks for the reserved slots. A group that N surely brings to its
length limit (max_tokens or max_model_len, whatever drafts it keeps) is left out of N+1, as a
synchronous step after N would leave it. Waiting groups are admitted into N+1 with the blocks
and budgets left (`Scheduler.admit_ahead`), as the admission stage of a synchronous step
would admit them: only with chunked prefill, and not while a waiting group outranks a running
one (a synchronous step might preempt for it). Anything else that N's result changes (a stop,
an abort, an export) takes effect one step later: a sequence that finished in N is computed
in N+1 too, and its output there is dropped, because output processing only reads sequences
that are still running. Its blocks are freed at once: the worker runs steps in order, so
N+1's write into them happens before any later step that reuses them.

Speculative decoding (scheduler_service/engine/speculation.py) chains through continuations. A
step N with drafts is continued by assuming N keeps them all: its sequences' updates in N+1
are sent `after_drafts` (the placeholder at the position after all of N's drafts, then drafts
of N+1's own, the proposal past N's drafts less its first token, which guesses N's sample),
their slots reserved that far. When N's result shows a sequence kept fewer, output processing
drops it from N+1 (`SchedulerOutputs.drop`) and gives its slots back, the worker skips its
update there but for the block table, and the step after N+1 is synchronous (N+1 no longer
runs every group). A step without drafts is not continued when a sequence in it has a draft
waiting, so that the drafts that start a run come from the real sample. A run whose drafts
keep being right thus pays no round trip between its steps: on the 2-core benchmark machine
that moved nothing (the scheduler's work then takes the cores from the forward pass instead
of filling a gap: bench/RESULTS.md), where the forward pass runs on a GPU it is the gap.

Constrained (grammar) sequences are continued too: always when forced tokens are off, and
with them on once a sequence's grammar has forced nothing for
`SchedulerConfig.forced_hold_tokens` tokens (see its comment). The mask of an N+1 row
depends on the token N samples, so N+1 goes out with its constrained rows deferred and their
masks are computed once N's result is processed, while the worker runs N+1's forward pass
(`LLMEngine.compute_masks`). When N's token makes the grammar force more tokens, they are
appended after N+1 was built: N+1 still computes N's token (its K/V is right), and its sample
for that row falls where the first forced token already is, so the row's mask allows that
token alone (output processing then skips the sample: the sequence has uncomputed tokens).
N+2 continues the row with the placeholder (standing for that first forced token, which the
worker sampled) followed by the rest of the run: one step more for the row than a
synchronous step would take, and no break in the pipeline. Whether that beats holding the
step back is a matter of how often grammars force (`SchedulerConfig.forced_hold_tokens`).

`PipelinedStepper` drives an in-process engine this way, one step ahead at most.
"""

from __future__ import annotations

from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import ScheduledGroup, SchedulerOutputs
from scheduler_service.engine.sequence import Sequence, SequenceStatus, tokens_left
from scheduler_service.engine.speculation import speculates

_RUNNING = SequenceStatus.RUNNING


def plan_continuation(scheduler: Scheduler, prev: SchedulerOutputs) -> SchedulerOutputs | None:
    """The continuation of `prev` (the step in flight), with its slots reserved; None when
    `prev`'s result may change what runs next, or the blocks are short."""
    config = scheduler.scheduler_config
    if scheduler.swapped or not prev.scheduled:
        return None
    if scheduler.waiting and not scheduler.can_admit_ahead():
        return None
    speculator = scheduler.speculator
    if (
        prev.drafts
        # Multi-step: every one is kept, unless the run is ended early for a request that
        # arrived (`ExecuteRequest.end_passes`); output processing then drops the sequence
        # from the continuation, as it does a sequence that rejected n-gram drafts.
        and not speculator.own_samples
        and (not config.continue_after_drafts or _constrained_drafts(prev))
    ):
        return None  # how many drafts it keeps decides where the next step starts
    model_len = config.model_len
    hold_window = config.forced_hold_tokens if config.enable_forced_tokens else 0
    speculating = speculator.enabled and len(scheduler.running) <= speculator.max_seqs
    drafts = prev.drafts
    groups: list[ScheduledGroup] = []
    seqs: list[Sequence] = []
    lookahead: list[int] = []  # per sequence: the slots it needs past its tokens
    num_tokens_scheduled = 0
    num_finishing = 0  # running groups that `prev` brings to their length limit
    for scheduled in prev.scheduled:
        group = scheduled.seq_group
        params = group.sampling_params
        group_seqs = group.seqs
        if len(group_seqs) == 1:  # most groups: no list built
            running = group_seqs if group_seqs[0].status is _RUNNING else ()
        else:
            running = [s for s in group_seqs if s.status is _RUNNING]
        if not running:
            continue  # finished or aborted since `prev` was scheduled
        if params.use_beam_search or (params.num_sampled > 1 and not group.has_sampled):
            return None
        chunk = scheduled.token_chunk_size
        max_tokens = params.max_tokens
        if _finish_in(running, chunk, max_tokens, model_len):
            num_finishing += 1
            continue
        next_chunk = 1
        for seq in running:
            if hold_window and _forced_lately(seq, hold_window):
                return None  # its grammar may force tokens soon (SchedulerConfig)
            if (
                speculating
                and seq.seq_id not in drafts
                and speculates(group)
                and seq.grammar is None
                and speculator.waits_for_draft(seq)
            ):
                return None  # the next step may start a run of drafts (_add_drafts)
            num_tokens = len(seq.token_ids)
            if seq.num_computed_tokens + chunk != num_tokens:
                if not _forced_after(seq, chunk, prev.is_continuation):
                    return None  # a prefill chunk short of the end samples nothing
                # Its grammar forced tokens after `prev` was built: `prev` samples the first
                # of them (its mask allows nothing else) and this step computes them all.
                next_chunk = num_tokens - seq.num_computed_tokens - chunk
            # Its tokens once `prev` is processed, if `prev` keeps every draft it carries.
            in_flight = drafts.get(seq.seq_id) if drafts else None
            ahead = 1 if in_flight is None else len(in_flight) + 1
            if tokens_left(num_tokens + ahead, seq.num_prompt_tokens, max_tokens, model_len) <= 0:
                return None  # may finish in `prev`: the next step is synchronous
            lookahead.append(ahead)
        groups.append(ScheduledGroup(group, next_chunk))
        seqs.extend(running)
        num_tokens_scheduled += next_chunk * len(running)
    if len(groups) + num_finishing != len(scheduler.running):
        return None  # a running group was left out of `prev` (budget): schedule normally
    if num_tokens_scheduled > config.token_budget:
        return None
    cont = SchedulerOutputs(
        scheduled=groups, num_batched_tokens=num_tokens_scheduled, is_continuation=True
    )
    cont.after_drafts.update(s.seq_id for s in seqs if s.seq_id in drafts)
    bm = scheduler.block_manager
    if not bm.can_reserve_lookahead(seqs, lookahead):
        return None
    bm.reserve_lookaheads(seqs, lookahead)
    scheduler.advance_clock()
    if scheduler.waiting:
        num_continued = len(cont.scheduled)
        scheduler.admit_ahead(cont)
        cont.num_admitted = len(cont.scheduled) - num_continued
    if not cont.scheduled:
        return None  # every group finishes in `prev`, and nothing was admitted
    _add_drafts(scheduler, prev, cont, seqs, lookahead)
    return cont


def _finish_in(running: list[Sequence], chunk: int, max_tokens: int, model_len: int) -> bool:
    """Whether `prev` (computing `chunk` tokens of each of a group's `running` sequences)
    surely brings them all to their length limit: each one's sample is its last token even if
    it keeps none of its drafts. Such a group is left out of the continuation, as a
    synchronous step after `prev` would leave it."""
    for seq in running:
        num_tokens = len(seq.token_ids)
        if seq.num_computed_tokens + chunk != num_tokens or (
            tokens_left(num_tokens + 1, seq.num_prompt_tokens, max_tokens, model_len) > 0
        ):
            return False
    return True


def _add_drafts(
    scheduler: Scheduler,
    prev: SchedulerOutputs,
    cont: SchedulerOutputs,
    seqs: list[Sequence],
    lookahead: list[int],
) -> None:
    """Speculative decoding in a continuation: drafts past the token `prev` samples for the
    continued sequences sent `after_drafts` (the worker skips such a sequence if `prev` keeps
    fewer drafts than it carries, and output processing drops it from `cont`,
    `SchedulerOutputs.drop`), guessed by assuming `prev` keeps its own. As in
    `Speculator.draft` they come last, after the admissions, within the rows, token budget
    and model limits, and out of the blocks left over (`lookahead[i]`: the slots seqs[i] has
    reserved already). A sequence without drafts in `prev` gets none here: the proposal would
    stand on a guess of `prev`'s sample (measured: more drafts in vain on text that does not
    repeat), so a continuation is not built when it has a draft waiting
    (`plan_continuation`), and the next step drafts from the sample itself. Multi-step passes
    are not given to a continuation that admits a prompt (its first token would wait for
    them)."""
    speculator = scheduler.speculator
    if not speculator.enabled:
        return
    if not speculator.own_samples:
        speculator.stats.num_after_drafts += len(cont.after_drafts)
    elif cont.num_admitted:
        return
    config = scheduler.scheduler_config
    bm = scheduler.block_manager
    rows = len(seqs) + sum(len(s.seq_group.seqs) for s in cont.admitted())
    if rows > speculator.max_seqs:
        return
    i = 0  # seqs[i]: the first running sequence of the group
    for scheduled in cont.continued():
        group = scheduled.seq_group
        first, i = i, i + sum(s.status == _RUNNING for s in group.seqs)
        seq = seqs[first]
        room = config.token_budget - cont.num_batched_tokens
        if rows >= speculator.max_batch or room <= 0:
            return
        in_flight = prev.drafts.get(seq.seq_id)
        if not in_flight or scheduled.token_chunk_size != 1 or not speculates(group):
            continue
        ahead = lookahead[first]  # as plan_continuation: the sample and `prev`'s drafts
        limit = min(
            speculator.k,
            room,
            speculator.max_batch - rows,
            seq.tokens_left(group.sampling_params.max_tokens, config.model_len, ahead) - 1,
        )
        drafts = speculator.continuation_drafts(seq, in_flight, limit)
        if not drafts or not bm.can_reserve_lookahead([seq], ahead + len(drafts)):
            continue
        bm.reserve_lookahead(seq, ahead + len(drafts))
        cont.drafts[seq.seq_id] = drafts
        cont.num_batched_tokens += len(drafts)
        rows += len(drafts)


def _constrained_drafts(prev: SchedulerOutputs) -> bool:
    """Whether a constrained sequence has drafts in `prev`: the masks of a step after it
    depend on how many it keeps, so it is not continued."""
    return any(
        s.seq_group.seqs[0].grammar is not None and s.seq_group.seqs[0].seq_id in prev.drafts
        for s in prev.scheduled
    )


def _forced_after(seq: Sequence, chunk: int, prev_is_continuation: bool) -> bool:
    """Whether the tokens of `seq` past `prev`'s chunk are a grammar's forced run appended
    since `prev` (a continuation) was built: `prev` computes the sampled token before them."""
    grammar = seq.grammar
    return (
        prev_is_continuation
        and chunk == 1
        and grammar is not None
        and grammar.forced_end == len(seq.token_ids)
    )


def _forced_lately(seq: Sequence, window: int) -> bool:
    """A constrained sequence whose grammar forced tokens within its last `window` tokens;
    the start of its output counts as forced (JSON opens with a forced run)."""
    grammar = seq.grammar
    if grammar is None:
        return False
    end = seq.num_prompt_tokens if grammar.forced_end is None else grammar.forced_end
    return len(seq.token_ids) - end < window


def commit_continuation(scheduler: Scheduler, cont: SchedulerOutputs) -> None:
    """After the previous step's tokens are appended: what `schedule()` would have done for
    the continued sequences that still run (their slots are reserved, so this only marks
    newly full blocks for the prefix cache; admitted ones got theirs when admitted). A
    sequence that got forced tokens besides its sample is left to the next `schedule()`,
    which finds (or preempts for) their slots."""
    appended: list[Sequence] = []
    for scheduled in cont.continued():
        chunk = scheduled.token_chunk_size
        for seq in scheduled.seq_group.seqs:
            if seq.status is _RUNNING and len(seq.token_ids) == seq.num_computed_tokens + chunk:
                appended.append(seq)
    scheduler.block_manager.append_reserved(appended)
