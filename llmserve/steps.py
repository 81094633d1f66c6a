"""The per-iteration contract between the scheduler and a worker.

`StepInput` is what the scheduler decided for one iteration; `StepResult` is what the worker
sampled. Both are plain dataclasses so in-process tests and benchmarks pass them directly;
the services send their proto form (worker.proto; llmserve/step_proto.py converts).

A step is a *diff*. A sequence's prompt and sampling params cross once, as a `NewSequence`;
afterwards a `CachedSequence` carries only the tokens the scheduler appended since the worker
last saw it (normally one), the block-table change, and how many tokens to compute.

The worker applies a step in this order:
  1. drop the state of `freed_seq_ids` (finished, aborted, or preempted by recompute);
  2. apply `forks`: the child starts as a copy of the parent's worker-side state (tokens,
     block table, computed count, and the recurrent layers' state, copied into the child's
     state slot) as it was *before* this step's updates;
  3. register `new_seqs`;
  4. apply `cached_seqs` updates (append tokens, patch block tables);
  5. `blocks_to_swap_out` (device -> host), then `blocks_to_swap_in` (host -> device), then
     `blocks_to_copy` (device -> device, copy-on-write), for every layer; the recurrent
     layers' states go first: the forks' state copies (step 2 names them: a fork's child got
     its slot before the step was scheduled, and the step may swap the child or its parent
     out), then the states move with the same direction lists (`states_to_swap_out`, then
     `states_to_swap_in`), then the prefix hits' state copies (step 3 names them; a slot a
     swapped-out state left may be one they write);
  6. run the forward pass over the scheduled tokens of every sequence in `new_seqs` and
     `cached_seqs`, in that order, and sample where a sequence reaches its last known token;
  7. `state_saves` (recurrent layers): copy state slots into snapshot slots (prefix caching).

A scheduled sequence computes tokens `[num_computed, num_computed + num_scheduled_tokens)` of
its known tokens, then `num_computed += num_scheduled_tokens`. It samples iff afterwards
`num_computed == len(token_ids)` (a prefill chunk that stops short samples nothing).

Asynchronous scheduling sends step N+1 before step N's result is back. A sequence that samples
in step N then continues in step N+1 with `new_token_ids == [SAMPLED_TOKEN]`: the worker
substitutes the token it sampled for that sequence in the last step that scheduled it. The
placeholder may be followed by tokens the scheduler appended after it (a grammar's forced
tokens, whose first one step N was made to sample by its mask). It is an error (the worker
refuses the step) if that step sampled nothing for the sequence, or if the placeholder is
anywhere but first. The scheduler learns the real token from step N's result and never sends
it again.

Speculative decoding: a `CachedSequence` that samples in this step may carry
`draft_token_ids`, k guesses of the tokens after its known ones (`num_scheduled_tokens`
counts them). The worker computes them right after the known tokens, samples at the last
known token and at each draft as if the tokens before were the sequence's, and keeps the
drafts while each equals the sample taken before it: with j drafts kept it produces j + 1
tokens (the kept drafts, then the sample after them) and appears j + 1 times in
`StepResult.outputs`, one `SequenceOutput` per token, in order. Afterwards the worker holds the
kept drafts as known, computed tokens; the rejected ones are gone (their cache slots are
written again later). The scheduler counts the kept drafts as computed and sends only the
last sample as the next step's new token.

Multi-step decoding: drafts that are all `SAMPLED_TOKEN` stand for the worker's own samples.
Such a sequence computes its last known token and samples, then computes that sample and
samples again, once per placeholder, each in a forward pass of its own (the step's other
sequences run in the first pass only), so every one is kept: with k placeholders it produces
k + 1 tokens, appears k + 1 times in `StepResult.outputs`, and afterwards holds the first k
as known, computed tokens, exactly as if they were k kept drafts. Its drafts are all
placeholders or none, and no token mask names it. The scheduler may end such runs early (a
request arrived, whose first token should not wait for them): then the passes stop after the
one running when the word came (`ExecuteRequest.end_passes`; at the earliest after the first
pass), as if the drafts not yet computed were rejected: with j passes more it produces j + 1
tokens and holds j of them as computed.

Transfers: a step may carry KV block transfers between workers, which the worker handles
before step 1: `released_transfer_ids` are forgotten, `exports` registered (a peer may read
those device blocks with ReadBlocks until a later step releases the transfer; the scheduler
keeps them allocated and unwritten meanwhile), then each of `imports` reads a peer's export
into this worker's device blocks, blocking the step until it has arrived or failed. The result
lists the imports done and those failed; a sequence may use imported blocks only in a later
step, once the scheduler has seen its import done.

A step that continues such a sequence before the result is back assumes every draft is kept:
the update is `[SAMPLED_TOKEN]` (the last token of the run) at the position after all the
drafts, marked `after_drafts`, and may carry drafts of its own. If the step before kept fewer
drafts, the worker applies that update's block-table change alone and computes and samples
nothing for the sequence in the step; the scheduler, seeing the same result, has dropped it
from that step and sends the sequence's real next token in a later one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from llmserve.sampling_params import SamplingParams

# Placeholder in `CachedSequence.new_token_ids`: "the token you sampled for this sequence in
# the previous step". The largest uint32, so the proto carries it unchanged; no vocabulary is
# that large.
SAMPLED_TOKEN = 0xFFFFFFFF


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has no state for: first prefill, or re-prefill after recompute."""

    seq_id: int
    request_id: str
    # Index of this sequence within its request (0 for the first); with `seed` it fixes the
    # sequence's random stream, so seeded output does not depend on ids or batch composition.
    seq_index: int
    # All tokens known so far: the prompt, then any output tokens (after a recompute).
    token_ids: list[int]
    num_prompt_tokens: int
    # Tokens whose K/V are already in the cache (a prefix-cache hit), so not computed again.
    num_computed_tokens: int
    # Physical device block ids covering at least num_computed + num_scheduled tokens: KV
    # group 0's table (`llmserve.kv_layout`).
    block_ids: list[int]
    num_scheduled_tokens: int
    sampling_params: SamplingParams
    # The tables of KV groups 1, 2, ... (empty for a model of one group). A windowed group's
    # table covers the step's window and tokens; entries before the window are NULL_BLOCK.
    group_block_ids: list[list[int]] = field(default_factory=list)
    # The recurrent layers' state slot (`llmserve.kv_layout`: state layers), None for a
    # model without them. Computing from token 0 it starts from zeros, whatever it held.
    state_slot: int | None = None
    # A prefix-cache hit's snapshot: the slot whose state (after `num_computed_tokens`) is
    # copied into `state_slot` before the forward pass (after the step's forks).
    state_from_slot: int | None = None


@dataclass(slots=True)
class CachedSequence:
    """Update for a sequence the worker already holds."""

    seq_id: int
    # Tokens appended by the scheduler since the worker last saw this sequence (usually one),
    # or `[SAMPLED_TOKEN, ...]` (a continuation step of asynchronous scheduling).
    new_token_ids: list[int]
    # The block table from index `block_offset` on is replaced by `block_ids` (an append when
    # block_offset == old length; copy-on-write or swap-in rewrite earlier entries).
    block_offset: int
    block_ids: list[int]
    # Tokens to compute in this step, `draft_token_ids` included.
    num_scheduled_tokens: int
    # Speculative decoding: guesses of the tokens that follow the known ones (see the module
    # docstring); empty for most steps.
    draft_token_ids: list[int] = field(default_factory=list)
    # Asynchronous scheduling after a step with drafts: this update was built assuming that
    # the last step that scheduled the sequence kept every draft it carried (its new tokens
    # are `[SAMPLED_TOKEN]`, at the position that follows them all). If that step kept fewer,
    # the worker applies the block-table edit alone: no token appended, nothing computed or
    # sampled for the sequence in this step.
    after_drafts: bool = False
    # The table edits of KV groups 1, 2, ..., one per group (empty for a model of one group).
    group_edits: list[TableEdit] = field(default_factory=list)


@dataclass(slots=True)
class TableEdit:
    """One KV group's block-table change: from index `offset` on, the table is `block_ids`
    (an append when `offset` is the old length). Entries before a windowed group's window
    may keep stale ids: the worker never reads them."""

    offset: int
    block_ids: list[int]


@dataclass(slots=True)
class Fork:
    """`child_seq_id` starts as a copy of `parent_seq_id` (n > 1 and beam search)."""

    parent_seq_id: int
    child_seq_id: int
    child_seq_index: int
    # The child's state slot (recurrent layers), into which the parent's state is copied.
    child_state_slot: int | None = None


class MaskKind(IntEnum):
    """How a `TokenMask` lists the allowed tokens (values match proto TokenMaskKind)."""

    ALLOW = 1  # token_ids are the allowed tokens
    DENY = 2  # every token below vocab_size is allowed except token_ids
    BITMAP = 3  # bit i of bitmap (byte i // 8, bit i % 8, little-endian) allows token i


@dataclass(slots=True)
class TokenMask:
    """The tokens one sequence may sample in this step (structured output). The scheduler
    picks the smallest encoding; a sequence with no mask may sample any token. Tokens at or
    above `vocab_size` (a model's padded vocabulary) are never allowed."""

    seq_id: int
    kind: MaskKind
    vocab_size: int
    token_ids: list[int] = field(default_factory=list)
    bitmap: bytes = b""
    # Which of the sequence's sampling rows it constrains: 0, its last known token's; i, the
    # row after its i-th draft (speculative decoding: a draft row samples under the grammar
    # as it stands after the drafts before it). A row without a mask samples freely.
    row: int = 0

    def allowed_ids(self) -> list[int]:
        """The allowed token ids, ascending (for tests and small masks)."""
        if self.kind == MaskKind.ALLOW:
            return sorted(self.token_ids)
        if self.kind == MaskKind.DENY:
            denied = set(self.token_ids)
            return [t for t in range(self.vocab_size) if t not in denied]
        bits = self.bitmap
        return [
            t for t in range(min(self.vocab_size, 8 * len(bits))) if bits[t >> 3] >> (t & 7) & 1
        ]


@dataclass(slots=True)
class BlockExport:
    """Device blocks peers may read under `transfer_id` (see the module doc: Transfers)."""

    transfer_id: int
    block_ids: list[int]
    # A state slot (recurrent layers: a prefix snapshot) peers read after the blocks.
    state_slot: int | None = None


@dataclass(slots=True)
class BlockImport:
    """Read the blocks `peer` exports under `transfer_id` into `block_ids`, one destination
    block per exported block, in the export's order."""

    transfer_id: int
    peer: str
    block_ids: list[int]
    # The state slot the export's snapshot goes into (None: it exports none, or this import
    # takes none).
    state_slot: int | None = None


@dataclass(slots=True)
class TransferFailure:
    transfer_id: int
    reason: str


@dataclass(slots=True)
class StepInput:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    cached_seqs: list[CachedSequence] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    # (source block, destination block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (sequence's state slot, snapshot slot) pairs copied after the forward pass.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Recurrent layers' states of swapped sequences: (device slot, host slot) pairs out,
    # (host slot, device slot) pairs in; a sequence swapped in may get another device slot.
    states_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    states_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Allowed tokens of the constrained sequences that sample in this step.
    token_masks: list[TokenMask] = field(default_factory=list)
    # Constrained sequences sampling in this step whose masks follow the step (computed while
    # the worker runs its forward pass); the worker waits for them before sampling.
    deferred_mask_seq_ids: list[int] = field(default_factory=list)
    # KV transfers between workers (see the module doc: Transfers).
    released_transfer_ids: list[int] = field(default_factory=list)
    exports: list[BlockExport] = field(default_factory=list)
    imports: list[BlockImport] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.cached_seqs)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.cached_seqs
        )

    def is_empty(self) -> bool:
        return not (
            self.new_seqs
            or self.cached_seqs
            or self.forks
            or self.freed_seq_ids
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
            or self.state_saves
            or self.states_to_swap_out
            or self.states_to_swap_in
            or self.released_transfer_ids
            or self.exports
            or self.imports
        )


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    # Log-probability under the model's raw distribution (log-softmax of the logits, before
    # temperature, penalties or filters), as vLLM v1 and HF report it.
    logprob: float
    # 1 = the most likely token.
    rank: int


@dataclass(slots=True)
class PromptLogprob:
    """Logprob of prompt token at `position` given the tokens before it."""

    position: int
    token: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class SequenceOutput:
    """What one sequence produced in a step. Only sequences that sampled appear; a sequence
    that verified drafts appears once per token it produced, in order."""

    seq_id: int
    # Sampled tokens. One normally; `best_of` at the first sample of a request with best_of > 1
    # (the scheduler forks the others); 2 * beam width candidates, best first, for beam search.
    samples: list[TokenLogprob]
    # Top `logprobs` alternatives of this step's distribution (empty when not requested).
    top_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt positions computed since the sequence last sampled (earlier prefill chunks' are
    # held back until it does), when prompt_logprobs was requested.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SequenceOutput] = field(default_factory=list)
    forward_ns: int = 0
    sample_ns: int = 0
    # Time waiting for the step's deferred masks after the forward pass (not in sample_ns).
    mask_wait_ns: int = 0
    # The step's imports: done (their blocks are in the cache), and failed.
    imported_transfer_ids: list[int] = field(default_factory=list)
    failed_imports: list[TransferFailure] = field(default_factory=list)


class Executor(Protocol):
    """Runs steps: a worker in-process, a gRPC worker client, or a fake model in tests."""

    def execute(self, step: StepInput) -> StepResult: ...
