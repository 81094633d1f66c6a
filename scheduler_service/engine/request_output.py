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


def concat_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: each choice's tokens and logprobs in
    order, its latest logprob total and finish state, `then`'s request state. Neither input
    is changed."""
    choices = {c.index: c for c in first.outputs}
    for c in then.outputs:
        before = choices.get(c.index)
        if before is not None:
            logprobs = None
            if before.logprobs is not None or c.logprobs is not None:
                logprobs = (before.logprobs or []) + (c.logprobs or [])
            c = CompletionOutput(
                c.index,
                before.token_ids + c.token_ids,
                c.cumulative_logprob,
                logprobs,
                c.finish_reason,
                c.stop_token_id,
            )
        choices[c.index] = c
    prompt_logprobs = first.prompt_logprobs
    if then.prompt_logprobs is not None:
        prompt_logprobs = (prompt_logprobs or []) + then.prompt_logprobs
    return RequestOutput(
        then.request_id,
        then.prompt_token_ids,
        sorted(choices.values(), key=lambda c: c.index),
        then.finished,
        prompt_logprobs,
        then.error,
        then.metrics,
    )
