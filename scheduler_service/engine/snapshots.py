"""Moving a request between replicas: what survives the move, and how it is rebuilt.

A `GroupSnapshot` is everything the scheduler knows about a request that does not depend on
a worker: the prompt, the parameters, the priority and stop strings, every generated token with its logprobs, the finish
state of each sequence, the prompt logprobs already sent and the request's timings. No block
ids and no sequence ids: the target replica gives the sequences new ids and recomputes their
KV cache (as a recompute preemption would), reusing its own prefix cache where it can.

Snapshots come from two places: `LLMEngine.export_requests` (a drained or lost replica, whose
engine state the scheduler still holds) and `snapshot_from_choices` (what the gateway has been
sent: after a contained step failure, or a re-submission after a scheduler restart). Seeded
sampling continues exactly after a move, because the workers draw a seeded sequence's noise
from (seed, sequence index, number of tokens so far), all of which the snapshot keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.sampling_params import SamplingParams
from llmserve.steps import PromptLogprob
from scheduler_service.engine.sequence import (
    FINISH_REASONS,
    FinishReason,
    RequestMetrics,
    SampleLogprobs,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from scheduler_service.engine.text_stops import StopStrings

_STATUS_OF_REASON: dict[FinishReason, SequenceStatus] = {
    reason: status for status, reason in FINISH_REASONS.items()
}


@dataclass(slots=True)
class SequenceSnapshot:
    """One sequence (a choice, a beam) of a moving request."""

    seq_index: int
    output_token_ids: list[int]
    # One entry per output token when the request asked for logprobs; empty otherwise.
    output_logprobs: list[SampleLogprobs]
    cumulative_logprob: float
    # None while the sequence is unfinished.
    finish_reason: FinishReason | None
    stop_token_id: int | None


@dataclass(slots=True)
class GroupSnapshot:
    """A whole request (every sibling together), ready to be queued on another replica."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # Empty, or one per sequence. Empty and `has_sampled` False: nothing generated yet.
    seqs: list[SequenceSnapshot] = field(default_factory=list)
    # Whether the group has sampled (for best_of > 1: whether it has forked).
    has_sampled: bool = False
    # The seq_index the next forked sequence (a new beam) gets.
    next_seq_index: int = 0
    # Prompt logprobs already emitted; a recompute does not emit them again.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # Timings so far (first scheduled, first token), so TTFT is measured once per request.
    metrics: RequestMetrics | None = None
    # Lower is served first.
    priority: int = 0
    # The request's stop strings (None: none); the target decodes the output again for them.
    stop_strings: StopStrings | None = None
    # What the output must match (None: free text); the target replays the output through a
    # fresh matcher per sequence.
    grammar: GrammarSpec | None = None
    # The output's reasoning block (None: none), replayed with the grammar.
    reasoning: ReasoningSpec | None = None


def snapshot_from_choices(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    arrival_time: float,
    choices: list[SequenceSnapshot],
    priority: int = 0,
    stop_strings: StopStrings | None = None,
    grammar: GrammarSpec | None = None,
    reasoning: ReasoningSpec | None = None,
) -> GroupSnapshot:
    """The snapshot of a request whose choices stream (`params.streams_choices`), from what
    its client has been sent: one `SequenceSnapshot` per choice, indexed by choice index.
    With no choices it is a new request."""
    seqs = sorted(choices, key=lambda s: s.seq_index)
    return GroupSnapshot(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        seqs=[
            replace(
                s,
                output_token_ids=list(s.output_token_ids),
                output_logprobs=list(s.output_logprobs),
            )
            for s in seqs
        ],
        has_sampled=bool(seqs),
        next_seq_index=max((s.seq_index for s in seqs), default=-1) + 1,
        priority=priority,
        stop_strings=stop_strings,
        grammar=grammar,
        reasoning=reasoning,
    )


def snapshot_group(seq_group: SequenceGroup) -> GroupSnapshot:
    """The snapshot of a live group (the engine's export)."""
    return GroupSnapshot(
        request_id=seq_group.request_id,
        prompt_token_ids=list(seq_group.prompt_token_ids),
        sampling_params=seq_group.sampling_params,
        eos_token_id=seq_group.seqs[0].eos_token_id,
        arrival_time=seq_group.arrival_time,
        seqs=[
            SequenceSnapshot(
                seq.seq_index,
                seq.get_output_token_ids(),
                list(seq.output_logprobs),
                seq.cumulative_logprob,
                seq.finish_reason(),
                seq.stop_token_id,
            )
            for seq in seq_group.seqs
        ],
        has_sampled=seq_group.has_sampled,
        next_seq_index=seq_group.next_seq_index,
        prompt_logprobs=list(seq_group.prompt_logprobs),
        metrics=replace(seq_group.metrics),
        priority=seq_group.priority,
        stop_strings=seq_group.stop_strings,
        grammar=seq_group.grammar,
        reasoning=seq_group.reasoning,
    )


def rebuild_group(
    snapshot: GroupSnapshot, new_seq_id: Callable[[], int], block_size: int
) -> SequenceGroup:
    """A `SequenceGroup` from `snapshot`: new sequence ids (from `new_seq_id()`), unfinished
    sequences WAITING with nothing computed, finished ones kept as they were. Stop strings
    are not started here (the engine does it, with its tokenizer)."""
    prompt = snapshot.prompt_token_ids
    records = snapshot.seqs or [SequenceSnapshot(0, [], [], 0.0, None, None)]
    seqs: list[Sequence] = []
    for record in records:
        seq = Sequence(new_seq_id(), prompt, block_size, snapshot.eos_token_id, record.seq_index)
        seq.token_ids.extend(record.output_token_ids)
        seq.output_logprobs = list(record.output_logprobs)
        seq.cumulative_logprob = record.cumulative_logprob
        seq.stop_token_id = record.stop_token_id
        if record.finish_reason is not None:
            seq.status = _STATUS_OF_REASON[FinishReason(record.finish_reason)]
        seqs.append(seq)
    group = SequenceGroup(
        snapshot.request_id,
        seqs,
        snapshot.sampling_params,
        snapshot.arrival_time,
        snapshot.priority,
        snapshot.stop_strings,
        snapshot.grammar,
        snapshot.reasoning,
    )
    if snapshot.metrics is not None:
        group.metrics = replace(snapshot.metrics)
    group.prompt_logprobs = list(snapshot.prompt_logprobs)
    group.has_sampled = snapshot.has_sampled
    group.next_seq_index = max(group.next_seq_index, snapshot.next_seq_index)
    return group
