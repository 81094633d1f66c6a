"""The worker's checks of the state slots a step names (a model with recurrent layers): a slot
held by another live sequence, or computed tokens without a snapshot, stop the step."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import NewSequence, StepInput
from worker_service.sequence_state import SequenceStates, StateError


def _new(seq_id: int, slot: int, computed: int = 0, source: int | None = None) -> NewSequence:
    return NewSequence(
        seq_id, f"r{seq_id}", 0, [1, 2, 3, 4], 4, computed, [seq_id], 4 - computed,
        SamplingParams(), state_slot=slot, state_from_slot=source,
    )  # fmt: skip


def _states() -> SequenceStates:
    states = SequenceStates(block_size=4)
    states.num_state_slots = 4
    return states


def test_a_slot_held_by_a_live_sequence_is_refused_in_the_same_step_and_the_next() -> None:
    with pytest.raises(StateError, match="state slot 1 is held by seq 1"):
        _states().apply_updates(StepInput(0, new_seqs=[_new(1, 1), _new(2, 1)]))
    states = _states()
    states.apply_updates(StepInput(0, new_seqs=[_new(1, 1)]))
    with pytest.raises(StateError, match="held by seq 1"):
        states.apply_updates(StepInput(1, new_seqs=[_new(2, 1)]))
    # Freed in the step that reuses it: applied first, so the slot is free again.
    states.apply_updates(StepInput(2, freed_seq_ids=[1], new_seqs=[_new(2, 1)]))


def test_computed_tokens_need_a_snapshot_which_is_copied_in() -> None:
    with pytest.raises(StateError, match="no snapshot"):
        _states().apply_updates(StepInput(0, new_seqs=[_new(1, 0, computed=2)]))
    states = _states()
    states.apply_updates(StepInput(0, new_seqs=[_new(1, 0, computed=2, source=3)]))
    assert states.state_copies == [(3, 0)]
