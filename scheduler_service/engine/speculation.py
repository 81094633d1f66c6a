"""Speculative decoding in the scheduler (issue #28): drafts proposed while a step is built,
kept or dropped when its result comes back.

`Speculator.draft` runs on each `Scheduler.schedule()` decision before its step is built
(`LLMEngine.begin_step`). Each decode of a request with one sequence (no beam search, no
n > 1) asks the proposer (`scheduler_service.engine.proposer`) for up to `num_speculative_tokens`
drafts; under a grammar they are cut where it refuses one or where one would complete it
(`SequenceGrammar.accepted_prefix`), and each draft row then samples under the mask after the
drafts before it (`SequenceGrammar.row_masks`, `TokenMask.row`). The drafts ride in the step
(`CachedSequence.draft_token_ids`), their K/V slots reserved from the free blocks. Drafts
come last in the step's decisions, after every admission and preemption, and only out of the
blocks and token budget left over: under pressure a sequence gets fewer drafts or none, and
nothing is ever preempted for them. Only steps of at most `speculative_max_seqs` sequences
get drafts, and a step's sequences and drafts stay within
`speculative_max_batch` rows: a decode step is paid by the weights it reads while it is small
(the native step on a CPU up to its batch limit, a GPU far beyond), and verifying more rows
than that costs more than the drafts save.

The worker computes the drafts with the sequence's last token, samples at each position as
a step without drafts would, and keeps the drafts while each equals the sample before it
(`llmserve.steps`). Output processing appends the tokens produced one at a time, each through
the usual stop checks, so a stop inside the run cuts it where a step-by-step run stops; then
`commit` counts the kept drafts as computed, gives the unused reserved blocks back, and makes
the blocks the kept tokens filled findable by the prefix cache. Rejected drafts never enter a
sequence, its proposer state or the prefix cache.

Asynchronous scheduling does not continue a step with drafts before its result, unless
`continue_after_drafts` is on: then it assumes they are all kept and gives the next step
drafts of its own past them (`scheduler_service.engine.pipelined_steps`). A step without drafts is
continued unless a sequence in it has a draft waiting (then the next step is built after
the result, so it can carry drafts drawn from the real sample).

Multi-step decoding (`SchedulerConfig.decode_steps`) runs through the same path when n-gram
drafts are off: the proposer is `OwnSamples`, whose drafts are placeholders the worker fills
with its own samples, a forward pass each (`llmserve.steps`), so every one is kept, unless
the service ends the runs early when a request arrives (`ExecuteRequest.end_passes`): the
result then reads as drafts rejected. Only steps of at most `decode_steps_max_seqs` sequences
get them (each placeholder is a pass of its own, so no row limit applies), never a
constrained sequence, and never in a step that computes a prompt (a prefill chunk, an
admitted or recomputed request, a moved one landing), whose first token would otherwise wait
for every pass; they count in no speculation statistic, and a step with them is always
continued.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from scheduler_service.engine.block_manager import BlockSpaceManager
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.engine.proposer import DraftProposer, NgramProposer, OwnSamples
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


@dataclass(slots=True)
class SpeculationStats:
    """Cumulative counters, as vLLM v1 reports them."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: how many times the draft at position i was kept.
    accepted_per_position: list[int] = field(default_factory=list)
    # --continue-after-drafts: updates sent assuming a step in flight keeps its drafts, and
    # those dropped because it did not (scheduler_service/engine/pipelined_steps.py).
    num_after_drafts: int = 0
    num_after_drafts_dropped: int = 0


def speculates(seq_group: SequenceGroup) -> bool:
    """Whether drafts may run for the group: one sequence sampling one token per step (under
    a grammar, the drafts it accepts, each row sampled under the mask after the drafts
    before it)."""
    params = seq_group.sampling_params
    return len(seq_group.seqs) == 1 and params.num_sampled == 1 and not params.use_beam_search


def _computes_a_prompt(out: SchedulerOutputs, held: Container[int]) -> bool:
    """Whether the step computes a prompt (or a recomputed request's tokens): a chunk of more
    than one token, or a sequence the worker does not hold yet."""
    return any(
        s.token_chunk_size != 1 or s.seq_group.seqs[0].seq_id not in held for s in out.scheduled
    )


class Speculator:
    """Drafts for one replica's steps, and what became of them."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockSpaceManager,
        proposer: DraftProposer | None = None,
    ) -> None:
        """`proposer`: n-gram prompt lookup from `config` unless given (tests pass their own)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.max_seqs = config.speculative_max_seqs
        self.block_manager = block_manager
        self.proposer = proposer
        # Multi-step decoding: the drafts are the worker's own samples, all kept unless a run
        # is ended early (module docstring); they count in no speculation statistic.
        self.own_samples = proposer is None and self.k == 0 and config.decode_steps > 1
        if self.own_samples:
            self.k = config.decode_steps - 1
            self.max_seqs = config.decode_steps_max_seqs
            # Each placeholder is a forward pass of its own: no step grows past its sequences.
            self.max_batch = config.token_budget
            self.proposer = OwnSamples(self.k)
        elif proposer is None and self.k > 0:
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max, self.k)
        self.stats = SpeculationStats(accepted_per_position=[0] * self.k)

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def proposal(self, seq: Sequence, limit: int, assumed: list[int] | None = None) -> list[int]:
        """Up to `limit` drafts to follow `seq`'s tokens, and `assumed` after them ([] when
        the proposer has none)."""
        assert self.proposer is not None
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = self.proposer.new_state(seq.token_ids)
        else:
            state.extend(seq.token_ids[state.num_tokens :])
        return self.proposer.propose(state, limit, assumed or ())

    def continuation_drafts(self, seq: Sequence, in_flight: list[int], limit: int) -> list[int]:
        """Up to `limit` drafts for a continuation step (`scheduler_service.engine.pipelined_steps`),
        which computes the token the step in flight samples for `seq` after `in_flight`, that
        step's drafts: the proposal past them, less its first token (the guess of that
        sample, which the continuation's placeholder stands for)."""
        if self.proposer is None or limit <= 0:
            return []
        if self.own_samples:
            return self.proposal(seq, limit)
        return self.proposal(seq, limit + 1, in_flight)[1:]

    def draft(self, out: SchedulerOutputs, held: Container[int]) -> None:
        """Give the decision's eligible decodes their drafts, within the token budget and
        the free blocks. `held`: the ids of the sequences the worker holds (drafts follow
        its known tokens; a sequence admitted or recomputed in this step has none there)."""
        if self.proposer is None:
            return  # speculation is off
        rows = sum(len(s.seq_group.seqs) for s in out.scheduled)  # at least one per sequence
        if rows >= self.max_batch or rows > self.max_seqs:
            return
        if self.own_samples and _computes_a_prompt(out, held):
            return  # its first token would wait for every pass
        bm = self.block_manager
        model_len = self.config.model_len
        token_budget = self.config.token_budget
        for scheduled in out.scheduled:
            room = token_budget - out.num_batched_tokens
            if room <= 0:
                return
            group = scheduled.seq_group
            if scheduled.token_chunk_size != 1 or not speculates(group):
                continue
            seq = group.seqs[0]
            num_tokens = len(seq.token_ids)
            if (
                seq.status != _RUNNING
                or seq.num_computed_tokens + 1 != num_tokens
                or seq.seq_id not in held
            ):
                continue
            # The step produces 1 + kept drafts tokens; none past max_tokens or the model.
            limit = min(
                self.k,
                room,
                self.max_batch - rows,
                seq.tokens_left(group.sampling_params.max_tokens, model_len) - 1,
            )
            if limit <= 0:
                continue
            drafts = self.proposal(seq, limit)
            if drafts and seq.grammar is not None:
                if self.own_samples:
                    continue  # each pass would need the grammar's mask after the last
                drafts = seq.grammar.accepted_prefix(drafts)
            if not drafts or not bm.can_reserve_lookahead([seq], len(drafts)):
                continue
            bm.reserve_lookahead(seq, len(drafts))
            out.drafts[seq.seq_id] = drafts
            out.num_batched_tokens += len(drafts)
            rows += len(drafts)
            if rows >= self.max_batch:
                return

    def waits_for_draft(self, seq: Sequence) -> bool:
        """Whether `seq` (in a step in flight, its sample not known) has a draft for the
        current end of its tokens: likely in a run its context repeats, so the next step is
        better built after the result, with drafts, than continued without them."""
        return self.proposer is not None and bool(self.proposal(seq, 1))

    def commit(
        self,
        seq_group: SequenceGroup,
        num_drafts: int,
        num_kept: int,
        ahead: int = 0,
        dropped: bool = False,
    ) -> None:
        """After output processing appended the step's tokens for the group's sequence (the
        kept drafts and one sample, or fewer if it stopped): the kept drafts are computed;
        the reserved blocks past its tokens and `ahead` slots more (the drafts of the
        continuation in flight after the step) go back. `dropped`: output processing took
        the sequence out of that continuation, built assuming every draft was kept."""
        seq = seq_group.seqs[0]
        if not self.own_samples:
            metrics = seq_group.metrics
            metrics.num_draft_tokens += num_drafts
            metrics.num_accepted_tokens += num_kept
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += num_kept
            for i in range(num_kept):
                stats.accepted_per_position[i] += 1
            stats.num_after_drafts_dropped += dropped
            if seq.draft_state is not None:
                seq.draft_state.record(num_drafts, num_kept)
        if seq.status != _RUNNING:
            return  # finished in the run: its blocks are freed already
        first_written = seq.num_computed_tokens  # the first draft's position
        seq.num_computed_tokens += num_kept
        self.block_manager.commit_lookahead(seq, first_written, ahead)
