"""AddRequest.continuation: a request its gateway re-submits after a scheduler restart, with
what it had already streamed to its client (scheduler.proto's Continuation)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.errors import FieldError
from llmserve.proto_convert import (
    finish_reason_name,
    token_logprob_from_proto,
    token_logprobs,
)
from llmserve.sampling_params import SamplingParams
from llmserve.steps import TokenLogprob
from llmserve.v1 import common_pb2, scheduler_pb2


@dataclass(slots=True)
class ContinuedChoice:
    """One choice of a re-submitted request, as its gateway had streamed it (scheduler.proto)."""

    index: int
    # Every token id the choice has generated so far.
    token_ids: list[int]
    # One (chosen token, top alternatives) pair per token; empty unless logprobs were requested.
    logprobs: list[tuple[TokenLogprob, list[TokenLogprob]]]
    cumulative_logprob: float
    # "stop" | "length" | "abort" | "ignored" when the choice had finished; None otherwise.
    finish_reason: str | None = None
    # The stop token id that finished the choice, if one did.
    stop_token_id: int | None = None


def continuation_from_proto(
    msg: scheduler_pb2.Continuation, params: SamplingParams
) -> list[ContinuedChoice]:
    """The choices of a continuation, sorted by index, checked against the
    request's `params`. Raises FieldError naming the offending field."""
    if msg.choices and not params.streams_choices:
        raise FieldError(
            "continuation",
            "only requests whose choices stream (best_of == n, no beam search) "
            "can continue; re-submit the others without a continuation",
        )
    choices: dict[int, ContinuedChoice] = {}
    for c in msg.choices:
        if c.index >= params.n or c.index in choices:
            problem = "appears twice" if c.index in choices else f"is not below n={params.n}"
            raise FieldError("continuation.choices.index", f"{c.index} {problem}")
        token_ids = list(c.token_ids)
        if len(token_ids) > params.max_tokens:
            raise FieldError(
                "continuation.choices.token_ids",
                f"choice {c.index} has {len(token_ids)} tokens, more than max_tokens="
                f"{params.max_tokens}",
            )
        want_logprobs = len(token_ids) if params.logprobs is not None else 0
        if len(c.logprobs) != want_logprobs:
            raise FieldError(
                "continuation.choices.logprobs",
                f"choice {c.index} has {len(c.logprobs)} logprobs for {len(token_ids)} tokens"
                + ("" if want_logprobs else " (the request asked for none)"),
            )
        if c.finish_reason not in common_pb2.FinishReason.values():
            raise FieldError(
                "continuation.choices.finish_reason", f"unknown value {c.finish_reason}"
            )
        choices[c.index] = ContinuedChoice(
            index=c.index,
            token_ids=token_ids,
            logprobs=[
                (token_logprob_from_proto(lp.token), token_logprobs(lp.top)) for lp in c.logprobs
            ],
            cumulative_logprob=c.cumulative_logprob,
            finish_reason=finish_reason_name(c.finish_reason),
            stop_token_id=c.stop_token_id if c.HasField("stop_token_id") else None,
        )
    return [choices[i] for i in sorted(choices)]
