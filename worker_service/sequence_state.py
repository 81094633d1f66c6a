"""A worker's copy of each sequence, kept from the scheduler's step diffs (steps 1-4 of the
contract in `llmserve.steps`): free, fork, register, update, and the sampled-token
placeholder of asynchronous scheduling. No tensors: `ModelRunner` builds its inputs from
these states, and the simulated worker of the fleet benchmark (tests/support) keeps the same
bookkeeping without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.sampling_params import SamplingParams
from llmserve.steps import (
    SAMPLED_TOKEN,
    CachedSequence,
    PromptLogprob,
    SequenceOutput,
    StepInput,
    StepResult,
    TokenMask,
)


@dataclass(slots=True)
class SequenceState:
    """The worker's copy of one sequence."""

    seq_id: int
    request_id: str
    seq_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]  # KV group 0's table
    params: SamplingParams
    # The tables of KV groups 1, 2, ... (`llmserve.kv_layout`); empty for one group.
    group_tables: list[list[int]] = field(default_factory=list)
    # Prompt logprobs of chunks that did not sample yet; sent with the first sample.
    pending_prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # The token the last step that scheduled this sequence sampled for it (None: it sampled
    # nothing, or several); what a `SAMPLED_TOKEN` placeholder stands for.
    last_sampled: int | None = None
    # Whether the last step that verified drafts for this sequence dropped some of them, or
    # ended its multi-step run early (an update `after_drafts` is then skipped).
    drafts_cut: bool = False
    # The recurrent layers' state slot (None: the model has none, or it is swapped out: then
    # `host_state_slot` holds it).
    state_slot: int | None = None
    host_state_slot: int | None = None

    def fork(
        self, child_seq_id: int, child_seq_index: int, child_state_slot: int | None
    ) -> SequenceState:
        return SequenceState(
            child_seq_id,
            self.request_id,
            child_seq_index,
            list(self.token_ids),
            self.num_prompt_tokens,
            self.num_computed,
            list(self.block_ids),
            self.params,
            [list(t) for t in self.group_tables],
            state_slot=child_state_slot,
        )


@dataclass(slots=True)
class Scheduled:
    """One sequence's part of a step."""

    state: SequenceState
    start: int  # first position computed this step
    count: int  # tokens computed this step, drafts included
    order: int  # position in the step's new_seqs + cached_seqs order
    # Draft tokens (speculative decoding): the last `num_drafts` of the computed tokens, held
    # in `state.token_ids` until the sampler settles them (`SequenceStates.keep_drafts`).
    num_drafts: int = 0
    # Multi-step decoding: forward passes after this one, each computing the token the pass
    # before sampled (the step's placeholder drafts, `llmserve.steps`).
    own_steps: int = 0

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.state.token_ids)

    @property
    def is_decode(self) -> bool:
        """Computes one known token (and its drafts): its rows are decode rows, each attending
        to the positions up to its own."""
        return self.count == self.num_drafts + 1

    def rows(self) -> range:
        """The positions whose logits it samples from: the last known token's, and each
        draft's."""
        end = self.start + self.count
        return range(end - 1 - self.num_drafts, end)


class StateError(RuntimeError):
    """The step refers to sequence state the worker does not have (a protocol bug)."""


class SequenceStates:
    """The sequences one worker holds, updated step by step; `apply_updates` returns what a
    step computes."""

    def __init__(self, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        # State slots of the recurrent layers in the cache (0: the model has none, or no
        # cache yet); set with the cache.
        self.num_state_slots = 0
        # The step's state slot copies, (source, destination): a fork's parent to its child
        # (`fork_copies`, made before the step's state swaps), a prefix hit's snapshot to its
        # sequence (`state_copies`, after them); all before the forward pass.
        self.fork_copies: list[tuple[int, int]] = []
        self.state_copies: list[tuple[int, int]] = []
        # This step: state slot -> the sequence holding it (built when a step adds one).
        self._slot_holders: dict[int, int] = {}
        self.states: dict[int, SequenceState] = {}
        # The current step's allowed tokens per constrained sequence (structured output), and
        # whether more follow the step (`StepInput.deferred_mask_seq_ids`).
        self.token_masks: dict[tuple[int, int], TokenMask] = {}  # by (seq id, row)
        self.masks_deferred = False

    def apply_updates(self, step: StepInput) -> list[Scheduled]:
        """Steps 1-4 of the contract (free, fork, register, update); returns what to compute."""
        for seq_id in step.freed_seq_ids:
            self.states.pop(seq_id, None)
        self.token_masks = {(m.seq_id, m.row): m for m in step.token_masks}
        self.masks_deferred = bool(step.deferred_mask_seq_ids)
        self.fork_copies = []
        self.state_copies = []
        if self.num_state_slots and step.forks:
            self._hold_slots()
        for fork in step.forks:
            parent = self._state(fork.parent_seq_id)
            child = parent.fork(fork.child_seq_id, fork.child_seq_index, fork.child_state_slot)
            self._check_state_slot(child)
            if parent.state_slot is not None and child.state_slot is not None:
                self.fork_copies.append((parent.state_slot, child.state_slot))
            self.states[fork.child_seq_id] = child
        # After the forks: the step may swap out a child it forks, or its parent.
        if step.states_to_swap_out or step.states_to_swap_in:
            self._swap_states(step)
        if self.num_state_slots and step.new_seqs:
            self._hold_slots()
        scheduled: list[Scheduled] = []
        for new in step.new_seqs:
            state = SequenceState(
                new.seq_id,
                new.request_id,
                new.seq_index,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.num_computed_tokens,
                list(new.block_ids),
                new.sampling_params,
                [list(t) for t in new.group_block_ids],
                state_slot=new.state_slot,
            )
            self._check_groups(state, len(new.group_block_ids))
            self._check_state_slot(state, new=True, source=new.state_from_slot)
            self.states[new.seq_id] = state
            if new.num_scheduled_tokens:
                scheduled.append(
                    Scheduled(state, state.num_computed, new.num_scheduled_tokens, len(scheduled))
                )
        for cached in step.cached_seqs:
            state = self._state(cached.seq_id)
            if cached.after_drafts and state.drafts_cut:
                # Built assuming every draft was kept: the block-table edit alone applies.
                del state.block_ids[cached.block_offset :]
                state.block_ids.extend(cached.block_ids)
                self._edit_groups(state, cached)
                continue
            new_tokens = cached.new_token_ids
            if SAMPLED_TOKEN in new_tokens:
                new_tokens = [self._take_sampled(state, new_tokens), *new_tokens[1:]]
            state.token_ids.extend(new_tokens)
            del state.block_ids[cached.block_offset :]
            state.block_ids.extend(cached.block_ids)
            self._edit_groups(state, cached)
            drafts = cached.draft_token_ids
            own = 0
            if drafts:
                self._check_drafts(state, cached.num_scheduled_tokens, len(drafts))
                own = self._own_samples(state, drafts)
                if own:
                    state.drafts_cut = False  # until the run ends early (`end_passes`)
                else:
                    state.token_ids.extend(drafts)
            if cached.num_scheduled_tokens:
                scheduled.append(
                    Scheduled(
                        state,
                        state.num_computed,
                        cached.num_scheduled_tokens - own,
                        len(scheduled),
                        len(drafts) - own,
                        own,
                    )
                )
        masked: set[int] | None = None
        for s in scheduled:
            if s.own_steps:
                if masked is None:
                    masked = {seq_id for seq_id, _ in self.token_masks}
                    masked.update(step.deferred_mask_seq_ids)
                if s.state.seq_id in masked:
                    raise StateError(f"seq {s.state.seq_id}: a token mask for multi-step decoding")
            end = s.start + s.count
            if end > len(s.state.token_ids):
                raise StateError(f"seq {s.state.seq_id}: scheduled past its known tokens")
            end += s.own_steps  # the block tables cover the later passes' positions too
            if end > len(s.state.block_ids) * self.block_size or any(
                end > len(t) * self.block_size for t in s.state.group_tables
            ):
                raise StateError(f"seq {s.state.seq_id}: scheduled past its block table")
        return scheduled

    def _hold_slots(self) -> None:
        self._slot_holders = {
            s.state_slot: s.seq_id for s in self.states.values() if s.state_slot is not None
        }

    def _swap_states(self, step: StepInput) -> None:
        """Where swapped sequences' states go: out to host slots, in to device slots."""
        on_device = {s.state_slot: s for s in self.states.values() if s.state_slot is not None}
        on_host = {
            s.host_state_slot: s for s in self.states.values() if s.host_state_slot is not None
        }
        for device, host in step.states_to_swap_out:
            state = on_device.pop(device, None)
            if state is None:
                raise StateError(f"no sequence holds state slot {device} to swap out")
            state.state_slot, state.host_state_slot = None, host
            on_host[host] = state
        for host, device in step.states_to_swap_in:
            state = on_host.pop(host, None)
            if state is None:
                raise StateError(f"no sequence holds host state slot {host} to swap in")
            state.state_slot, state.host_state_slot = device, None

    def _check_state_slot(
        self, state: SequenceState, new: bool = False, source: int | None = None
    ) -> None:
        """A model with recurrent layers gives every sequence its own slot in the cache; a
        new sequence starts from its first token, or from a copy of the snapshot `source`
        (a prefix hit), which the step's copies get before the forward pass."""
        seq_id, slot = state.seq_id, state.state_slot
        if (slot is None) != (self.num_state_slots == 0):
            raise StateError(
                f"seq {seq_id}: state slot {slot}, the cache has {self.num_state_slots} slots"
            )
        if slot is None:
            return
        if not 0 <= slot < self.num_state_slots:
            raise StateError(
                f"seq {seq_id}: state slot {slot} is outside the cache "
                f"({self.num_state_slots} slots)"
            )
        if new and state.num_computed and source is None:
            raise StateError(
                f"seq {seq_id}: {state.num_computed} tokens computed before its first step, "
                "and no snapshot of their state given"
            )
        if source is not None:
            if not 0 <= source < self.num_state_slots:
                raise StateError(f"seq {seq_id}: snapshot slot {source} is outside the cache")
            self.state_copies.append((source, slot))
        holder = self._slot_holders.setdefault(slot, seq_id)
        if holder != seq_id:
            raise StateError(f"seq {seq_id}: state slot {slot} is held by seq {holder}")

    def _check_groups(self, state: SequenceState, num_other: int) -> None:
        if num_other != self.num_groups - 1:
            raise StateError(
                f"seq {state.seq_id}: {num_other + 1} KV group tables, the model has "
                f"{self.num_groups}"
            )

    def _edit_groups(self, state: SequenceState, cached: CachedSequence) -> None:
        """Apply a cached update's table edits of KV groups 1, 2, ..."""
        edits = cached.group_edits
        self._check_groups(state, len(edits))
        for table, edit in zip(state.group_tables, edits, strict=True):
            del table[edit.offset :]
            table.extend(edit.block_ids)

    @staticmethod
    def _check_drafts(state: SequenceState, num_scheduled: int, num_drafts: int) -> None:
        """Drafts follow the one known token a sampling sequence computes, and never come with
        beam search (its candidates are not a sample)."""
        seq_id = state.seq_id
        if state.num_computed + num_scheduled != len(state.token_ids) + num_drafts:
            raise StateError(
                f"seq {seq_id}: {num_drafts} drafts must end the step's scheduled tokens "
                f"({num_scheduled} from position {state.num_computed}, "
                f"{len(state.token_ids)} known)"
            )
        if num_scheduled != num_drafts + 1:
            raise StateError(
                f"seq {seq_id}: drafts follow one known token computed in the same step, got "
                f"{num_scheduled} scheduled tokens for {num_drafts} drafts"
            )
        if state.params.use_beam_search:
            raise StateError(f"seq {seq_id}: beam search cannot have drafts")

    @staticmethod
    def next_pass(pending: list[Scheduled], outputs: list[SequenceOutput]) -> list[Scheduled]:
        """Multi-step decoding: each of `pending` appends the token it sampled in the pass
        before (`outputs`) and computes it in a pass of its own."""
        sampled = {out.seq_id: out.samples[0].token_id for out in outputs}
        passing = []
        for s in pending:
            state = s.state
            state.token_ids.append(sampled[state.seq_id])
            passing.append(
                Scheduled(state, state.num_computed, 1, s.order, own_steps=s.own_steps - 1)
            )
        return passing

    @staticmethod
    def end_passes(pending: list[Scheduled]) -> None:
        """Multi-step decoding ended early (`ExecuteRequest.end_passes`): `pending` compute no
        more passes, as if their remaining drafts were rejected. The sample of the last pass
        is the run's last token; the samples before it are known, computed tokens."""
        for s in pending:
            s.state.drafts_cut = True

    @staticmethod
    def _own_samples(state: SequenceState, drafts: list[int]) -> int:
        """How many of `drafts` stand for the worker's own samples (multi-step decoding): all
        of them or none."""
        own = drafts.count(SAMPLED_TOKEN)
        if own not in (0, len(drafts)):
            raise StateError(
                f"seq {state.seq_id}: {own} of {len(drafts)} drafts are the sampled-token "
                "placeholder; multi-step drafts are all placeholders"
            )
        return own

    @staticmethod
    def keep_drafts(s: Scheduled, kept: int) -> None:
        """After sampling: keep the first `kept` of `s`'s drafts as known, computed tokens and
        drop the rest."""
        state = s.state
        end = s.start + s.count - (s.num_drafts - kept)
        del state.token_ids[end:]
        state.num_computed = end
        state.drafts_cut = kept < s.num_drafts

    @staticmethod
    def _take_sampled(state: SequenceState, new_tokens: list[int]) -> int:
        """The token a `SAMPLED_TOKEN` placeholder stands for (asynchronous scheduling)."""
        if new_tokens[0] != SAMPLED_TOKEN or SAMPLED_TOKEN in new_tokens[1:]:
            raise StateError(
                f"seq {state.seq_id}: the sampled-token placeholder must be the first new "
                f"token and appear once, got {len(new_tokens)} new tokens"
            )
        token = state.last_sampled
        if token is None:
            raise StateError(
                f"seq {state.seq_id}: the step names the token sampled in the previous step, "
                "but that step sampled nothing for this sequence"
            )
        state.last_sampled = None
        return token

    def remember_samples(self, scheduled: list[Scheduled], result: StepResult) -> None:
        """Keep what each scheduled sequence sampled in this step, for the next step's
        placeholders (a sequence that sampled nothing, or several candidates, keeps none; one
        that verified drafts keeps the last token of its run)."""
        for s in scheduled:
            s.state.last_sampled = None
        states = self.states
        for out in result.outputs:
            if len(out.samples) == 1:
                states[out.seq_id].last_sampled = out.samples[0].token_id

    def _state(self, seq_id: int) -> SequenceState:
        state = self.states.get(seq_id)
        if state is None:
            raise StateError(f"no state for seq {seq_id}")
        return state
