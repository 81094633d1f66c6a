"""What a request produced: the per-step deltas (`RequestOutput`) output processing emits,
and a finished request's complete output (`final_output`)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.errors import ApiError
from llmserve.steps import PromptLogprob
from scheduler_service.engine.sequence import (
    FinishReason,
    RequestMetrics,
    SampleLogprobs,
    Sequence,
    SequenceGroup,
)


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request. In a step's delta `token_ids` / `logprobs` hold only what is
    new this step; in a final output (`offline.generate`) they hold everything."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    # Per token: its logprob and the top alternatives; None unless `logprobs` was requested.
    logprobs: list[SampleLogprobs] | None
    finish_reason: FinishReason | None = None
    # The stop token (EOS or one of stop_token_ids) that finished the choice, if any.
    stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in a step (a delta), or in total (from `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    # Choices with something new this step, sorted by index. With best_of > n or beam search
    # choices are only known at the end, so they come once, complete, with finished=True.
    outputs: list[CompletionOutput]
    finished: bool
    # New prompt logprobs (each position once, even if the prompt is computed again after a
    # preemption); None unless `prompt_logprobs` was requested.
    prompt_logprobs: list[PromptLogprob] | None = None
    # Why the request ended without output (`SequenceGroup.error`); sent as the error.
    error: ApiError | None = None
    metrics: RequestMetrics | None = None


def select_final_seqs(seq_group: SequenceGroup) -> list[Sequence]:
    """The n returned sequences, in choice-index order."""
    params = seq_group.sampling_params
    seqs = seq_group.seqs
    if params.streams_choices:
        return sorted(seqs, key=lambda s: s.seq_index)
    if params.use_beam_search:
        lp = params.length_penalty
        return sorted(seqs, key=lambda s: s.beam_score(lp), reverse=True)[: params.n]
    return sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]


def final_output(seq_group: SequenceGroup) -> RequestOutput:
    """The complete output of a request (all tokens of every returned choice)."""
    params = seq_group.sampling_params
    streams = params.streams_choices
    choices = []
    for rank, seq in enumerate(select_final_seqs(seq_group)):
        choices.append(
            CompletionOutput(
                index=seq.seq_index if streams else rank,
                token_ids=seq.get_output_token_ids(),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason(),
                stop_token_id=seq.stop_token_id,
            )
        )
    return RequestOutput(
        request_id=seq_group.request_id,
        prompt_token_ids=seq_group.prompt_token_ids,
        outputs=choices,
        finished=seq_group.is_finished(),
        prompt_logprobs=list(seq_group.prompt_logprobs)
        if params.prompt_logprobs is not None
        else None,
        error=seq_group.error,
        metrics=seq_group.metrics,
    )


def _owned_choice(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index,
        list(c.token_ids),
        c.cumulative_logprob,
        None if c.logprobs is None else list(c.logprobs),
        c.finish_reason,
        c.stop_token_id,
    )


def owned_delta(delta: RequestOutput) -> RequestOutput:
    """A copy of `delta` whose choices and lists `extend_delta` may change."""
    return RequestOutput(
        delta.request_id,
        delta.prompt_token_ids,
        [_owned_choice(c) for c in delta.outputs],
        delta.finished,
        None if delta.prompt_logprobs is None else list(delta.prompt_logprobs),
        delta.error,
        delta.metrics,
    )


def extend_delta(into: RequestOutput, then: RequestOutput) -> None:
    """Append `then`, the request's next delta, to `into` (an `owned_delta`, changed in place):
    each choice's tokens and logprobs in order, its latest logprob total and finish state,
    `then`'s request state. `then` is not changed."""
    choices = into.outputs
    for c in then.outputs:
        before = next((b for b in choices if b.index == c.index), None)
        if before is None:
            choices.append(_owned_choice(c))
            choices.sort(key=lambda b: b.index)
            continue
        before.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if before.logprobs is None:
                before.logprobs = []
            before.logprobs.extend(c.logprobs)
        before.cumulative_logprob = c.cumulative_logprob
        before.finish_reason = c.finish_reason
        before.stop_token_id = c.stop_token_id
    if then.prompt_logprobs is not None:
        into.prompt_logprobs = (into.prompt_logprobs or []) + then.prompt_logprobs
    into.finished = then.finished
    into.error = then.error
    into.metrics = then.metrics
