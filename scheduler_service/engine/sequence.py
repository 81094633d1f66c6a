"""Sequences and sequence groups: the scheduler's view of a request's token streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from llmserve.errors import ApiError
from llmserve.grammar.backend import GrammarError
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.sampling_params import SamplingParams
from llmserve.steps import PromptLogprob, TokenLogprob
from scheduler_service.engine.grammar import SequenceGrammar
from scheduler_service.engine.proposer import DraftState
from scheduler_service.engine.text_stops import StopStrings, TextStop


class SequenceStatus(IntEnum):
    """Ordered so that every status from STOPPED on is a finished one."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    STOPPED = 3
    LENGTH_CAPPED = 4
    ABORTED = 5
    IGNORED = 6

    def is_finished(self) -> bool:
        return self >= SequenceStatus.STOPPED


class FinishReason(StrEnum):
    """Why a sequence stopped, as reported to clients."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    IGNORED = "ignored"  # never scheduled: prompt too long for the model or the cache


FINISH_REASONS = {
    SequenceStatus.STOPPED: FinishReason.STOP,
    SequenceStatus.LENGTH_CAPPED: FinishReason.LENGTH,
    SequenceStatus.ABORTED: FinishReason.ABORT,
    SequenceStatus.IGNORED: FinishReason.IGNORED,
}


@dataclass(slots=True)
class SampleLogprobs:
    """The logprob of one output token and, when requested, the top alternatives."""

    token: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


def chain_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Content hash of a full block, chained through its parent so equal blocks at different
    positions (or after different prefixes) get different hashes."""
    return hash((parent_hash, token_ids))


class Sequence:
    """One token stream: the prompt followed by the tokens sampled so far."""

    __slots__ = (
        "seq_id",
        "seq_index",
        "block_size",
        "eos_token_id",
        "num_prompt_tokens",
        "token_ids",
        "output_logprobs",
        "cumulative_logprob",
        "num_computed_tokens",
        "status",
        "stop_token_id",
        "text_stop",
        "grammar",
        "draft_state",
        "_block_hashes",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        block_size: int,
        eos_token_id: int | None = None,
        seq_index: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.seq_index = seq_index
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        # One entry per output token when the request asked for logprobs (`append_sample`);
        # empty otherwise (`append_token`), so a long generation does not keep one object per
        # token alive for the garbage collector to scan.
        self.output_logprobs: list[SampleLogprobs] = []
        self.cumulative_logprob = 0.0
        # Tokens whose K/V are in the cache (or will be once the scheduled step has run).
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        # The stop token that finished this sequence (EOS or one of stop_token_ids).
        self.stop_token_id: int | None = None
        # Decoded text and stop-string state; None unless the request has stop strings.
        self.text_stop: TextStop | None = None
        # The grammar's matcher (structured output); None for unconstrained requests.
        self.grammar: SequenceGrammar | None = None
        # The draft proposer's state (speculative decoding), made on first need; derived from
        # token_ids alone, so never migrated.
        self.draft_state: DraftState | None = None
        self._block_hashes: list[int] = []

    # -- tokens ---------------------------------------------------------------------------

    def get_len(self) -> int:
        return len(self.token_ids)

    def get_prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def get_output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def get_output_len(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def tokens_left(self, max_tokens: int, model_len: int, ahead: int = 0) -> int:
        """`tokens_left` for this sequence once `ahead` more tokens are appended."""
        return tokens_left(
            len(self.token_ids) + ahead, self.num_prompt_tokens, max_tokens, model_len
        )

    def append_token_id(self, token_id: int, logprobs: dict[int, float]) -> None:
        """Append a sampled token; `logprobs` maps token ids to logprobs and holds `token_id`."""
        self.append_sample(SampleLogprobs(TokenLogprob(token_id, logprobs[token_id], 0)))

    def append_sample(self, sample: SampleLogprobs) -> None:
        """Append a sampled token and keep its logprobs."""
        self.token_ids.append(sample.token.token_id)
        self.output_logprobs.append(sample)
        self.cumulative_logprob += sample.token.logprob

    def append_token(self, token: TokenLogprob) -> None:
        """Append a sampled token without keeping its logprobs (the request did not ask)."""
        self.token_ids.append(token.token_id)
        self.cumulative_logprob += token.logprob

    def check_stop(self, params: SamplingParams, max_model_len: int) -> None:
        """Finish the sequence if the token it just appended stops it: EOS or a stop token id
        (from `min_tokens` on), a completed grammar, a stop string its text now holds, or a
        length limit. A constrained sequence's matcher advances over the token first; a token
        the grammar refuses (a mask that was not applied) aborts the sequence."""
        token_ids = self.token_ids
        token_id = token_ids[-1]
        num_tokens = len(token_ids)
        output_len = num_tokens - self.num_prompt_tokens
        grammar = self.grammar
        if grammar is not None and not _grammar_accepts(grammar, token_id):
            self.status = SequenceStatus.ABORTED
            return
        if output_len >= params.min_tokens and (
            (token_id == self.eos_token_id and not params.ignore_eos)
            or token_id in params.stop_token_ids
        ):
            self.status = SequenceStatus.STOPPED
            self.stop_token_id = token_id
            return
        if grammar is not None and grammar.is_terminated():
            self.status = SequenceStatus.STOPPED
            return
        if self.text_stop is not None and self.text_stop.add((token_id,)) is not None:
            self.status = SequenceStatus.STOPPED
            return
        if tokens_left(num_tokens, self.num_prompt_tokens, params.max_tokens, max_model_len) <= 0:
            self.status = SequenceStatus.LENGTH_CAPPED

    def start_text_stop(self, tokenizer: Any, stops: StopStrings) -> None:
        """Start decoding this sequence's text for `stops` (its output so far included)."""
        self.text_stop = TextStop.start(tokenizer, stops, self.get_prompt_token_ids())
        if self.get_output_len():
            self.text_stop.add(self.get_output_token_ids())

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    # -- status -----------------------------------------------------------------------------

    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.STOPPED

    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    # -- blocks -----------------------------------------------------------------------------

    def get_num_logical_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    def block_hash(self, index: int) -> int:
        """Chained content hash of full logical block `index` (computed once, then cached)."""
        hashes = self._block_hashes
        bs = self.block_size
        assert (index + 1) * bs <= len(self.token_ids), "only full blocks have a hash"
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else None
            hashes.append(chain_block_hash(parent, tuple(self.token_ids[i * bs : (i + 1) * bs])))
        return hashes[index]

    # -- beam search ------------------------------------------------------------------------

    def beam_score(self, length_penalty: float, length: int | None = None) -> float:
        """Cumulative logprob divided by (output length) ** length_penalty.

        The length counts output tokens only, not a trailing EOS (as HF transformers does for
        decoder-only models), so a finished beam is not rewarded for emitting EOS.
        """
        if length is None:
            length = self.get_output_len()
            if self.eos_token_id is not None and length and self.token_ids[-1] == self.eos_token_id:
                length -= 1
        return self.cumulative_logprob / (max(length, 1) ** length_penalty)

    def fork(self, new_seq_id: int, seq_index: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.seq_id = new_seq_id
        child.seq_index = seq_index
        child.block_size = self.block_size
        child.eos_token_id = self.eos_token_id
        child.num_prompt_tokens = self.num_prompt_tokens
        child.token_ids = list(self.token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.stop_token_id = None
        child.text_stop = None if self.text_stop is None else self.text_stop.fork()
        child.grammar = None if self.grammar is None else self.grammar.fork()
        child._block_hashes = list(self._block_hashes)
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()}, "
            f"computed={self.num_computed_tokens})"
        )


def tokens_left(num_tokens: int, num_prompt_tokens: int, max_tokens: int, model_len: int) -> int:
    """The length rule, the one place it is written: how many more tokens a sequence of
    `num_tokens` (`num_prompt_tokens` of them its prompt) may get before its length stops it
    (`max_tokens` generated, or `model_len` in all). 0 or less: it is stopped by length.
    Called for every sampled token, so plain comparisons rather than `min`."""
    by_output = max_tokens - (num_tokens - num_prompt_tokens)
    by_context = model_len - num_tokens
    return by_output if by_output < by_context else by_context


def _grammar_accepts(grammar: SequenceGrammar, token_id: int) -> bool:
    try:
        return grammar.accept(token_id)
    except GrammarError:  # it never compiled: the engine finishes the request
        return False


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: draft tokens verified for the request, and how many were kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SequenceGroup:
    """The sequences of one request. They share the prompt (and its KV blocks)."""

    __slots__ = (
        "request_id",
        "seqs",
        "sampling_params",
        "metrics",
        "prompt_token_ids",
        "prompt_logprobs",
        "has_sampled",
        "next_seq_index",
        "error",
        "priority",
        "stop_strings",
        "grammar",
        "reasoning",
    )

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        stop_strings: StopStrings | None = None,
        grammar: GrammarSpec | None = None,
        reasoning: ReasoningSpec | None = None,
    ) -> None:
        self.request_id = request_id
        # What every sequence's output must match (each holds its own matcher).
        self.grammar = grammar
        # The output's reasoning block: `grammar` applies after it, a budget closes it
        # (llmserve.grammar.reasoning).
        self.reasoning = reasoning
        # Lower is served first (vLLM's convention); queues are kept in (priority, arrival)
        # order (`order_key`).
        self.priority = priority
        # Matched by each sequence's `text_stop` once the engine has started them.
        self.stop_strings = stop_strings
        self.seqs: list[Sequence] = list(seqs)
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time)
        self.prompt_token_ids = seqs[0].get_prompt_token_ids()
        # Prompt logprobs as first received; a re-prefill after recompute does not add more.
        self.prompt_logprobs: list[PromptLogprob] = []
        # Whether any sequence has sampled: before that, best_of > 1 groups hold one sequence
        # but will need best_of slots once forked.
        self.has_sampled = False
        self.next_seq_index = max(s.seq_index for s in seqs) + 1
        # Why the request ended without output: a prompt it can never run (finished IGNORED),
        # a grammar that failed on this scheduler (ABORTED). The client gets this error.
        self.error: ApiError | None = None

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    def order_key(self) -> tuple[int, float]:
        """Queues are sorted by this: higher priority (lower value) first, then arrival."""
        return (self.priority, self.metrics.arrival_time)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status < SequenceStatus.STOPPED]

    def get_finished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status >= SequenceStatus.STOPPED]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        if status is None:
            return len(self.seqs)
        return sum(1 for s in self.seqs if s.status == status)

    def get_max_num_running_seqs(self) -> int:
        """Sequences this group may run at once: what budgets and preemption reason about."""
        if not self.has_sampled:
            return self.sampling_params.num_sampled
        seqs = self.seqs
        if len(seqs) == 1:
            return 1 if seqs[0].status < SequenceStatus.STOPPED else 0
        return sum(1 for s in seqs if s.status < SequenceStatus.STOPPED)

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def remove(self, seq_id: int) -> None:
        self.seqs = [s for s in self.seqs if s.seq_id != seq_id]

    def is_finished(self) -> bool:
        # A plain loop: called per group per step, measurably cheaper than all() + genexpr.
        for s in self.seqs:  # noqa: SIM110
            if s.status < SequenceStatus.STOPPED:
                return False
        return True

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"
