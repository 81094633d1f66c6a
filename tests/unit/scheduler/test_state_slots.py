"""State slots in the block manager (a model with recurrent layers): a request reserves what
its forks will need at admission, forks take from the reservation, and the reservation goes
back to the pool with the request's last sequence; snapshots for prefix hits, kept for
decoded blocks too, and held by KV transfers."""

from __future__ import annotations

from scheduler_service.engine import AllocStatus, BlockSpaceManager, SamplingParams
from scheduler_service.engine.prefix_hits import state_key
from scheduler_service.engine.sequence import SequenceStatus
from scheduler_service.engine.state_slots import slots_needed

from .factories import make_seq_group


def _manager(slots: int) -> BlockSpaceManager:
    return BlockSpaceManager(4, 64, 8, watermark=0.0, num_state_slots=slots)


def _admit(bm: BlockSpaceManager, request_id: str, params: SamplingParams | None = None):
    group = make_seq_group(request_id, list(range(1, 10)), params=params)
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    bm.check_invariants()
    return group


def test_slots_needed_covers_every_fork_to_come() -> None:
    assert slots_needed(make_seq_group("a", [1, 2])) == 1
    assert slots_needed(make_seq_group("b", [1, 2], params=SamplingParams(n=2, best_of=5))) == 5
    beam = SamplingParams(best_of=3, use_beam_search=True, temperature=0.0)
    assert slots_needed(make_seq_group("c", [1, 2], params=beam)) == 6


def test_each_sequence_gets_its_own_slot_and_forks_take_the_reserved_ones() -> None:
    bm = _manager(6)
    one = _admit(bm, "one")
    many = _admit(bm, "many", SamplingParams(n=4))
    slot_one = bm.state_slot(one.seqs[0].seq_id)
    parent = many.seqs[0]
    assert bm.state_slot(parent.seq_id) != slot_one
    assert bm.states is not None and bm.states.num_free() == 1  # 1 + 4 of 6 taken
    children = [parent.fork(100 + i, i + 1) for i in range(3)]
    for child in children:
        many.add(child)
        bm.fork(parent, child)
    held = {bm.state_slot(s.seq_id) for s in [one.seqs[0], *many.seqs]}
    assert len(held) == 5  # no slot given twice
    assert bm.states.num_free() == 1  # the forks took reserved slots, not free ones
    bm.check_invariants()


def test_the_reservation_returns_with_the_requests_last_sequence() -> None:
    bm = _manager(4)
    many = _admit(bm, "many", SamplingParams(n=3))
    parent = many.seqs[0]
    child = parent.fork(200, 1)
    many.add(child)
    bm.fork(parent, child)
    assert bm.states is not None and bm.states.num_free() == 1
    bm.free(child)  # its slot goes back to the request, not to the pool
    assert bm.states.num_free() == 1
    bm.check_invariants()
    bm.free(parent)
    assert bm.states.num_free() == 4
    bm.check_invariants()


def test_admission_waits_for_slots_and_refuses_a_request_that_never_fits() -> None:
    bm = _manager(4)
    _admit(bm, "first", SamplingParams(n=3))
    later = make_seq_group("later", [1, 2, 3], params=SamplingParams(n=2))
    assert bm.can_allocate(later) is AllocStatus.LATER  # 1 slot free, 2 needed
    beam = SamplingParams(best_of=3, use_beam_search=True, temperature=0.0)
    wide = make_seq_group("wide", [1], params=beam)
    assert bm.can_allocate(wide) is AllocStatus.NEVER
    assert "6 state slots" in bm.never_reason(wide) and "has (4)" in bm.never_reason(wide)


def test_a_swap_moves_the_state_to_a_host_slot_and_back_to_a_free_one() -> None:
    bm = _manager(2)
    first = _admit(bm, "first")
    seq = first.seqs[0]
    slot = bm.state_slot(seq.seq_id)
    assert bm.can_swap_out(first)
    moves: list[tuple[int, int]] = []
    bm.swap_out(first, moves)
    seq.status = SequenceStatus.SWAPPED
    assert [device for device, _ in moves] == [slot]
    bm.check_invariants()
    _admit(bm, "second")  # takes the slot the swapped state left
    assert bm.states is not None and bm.states.num_free() == 1
    back: list[tuple[int, int]] = []
    assert bm.can_swap_in(first)
    bm.swap_in(first, back)
    seq.status = SequenceStatus.RUNNING
    assert back == [(moves[0][1], bm.state_slot(seq.seq_id))]
    assert bm.state_slot(seq.seq_id) != slot
    bm.check_invariants()


def test_no_hit_without_a_snapshot() -> None:
    bm = _manager(4)
    first = _admit(bm, "first")
    seq = first.seqs[0]
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)
    again = make_seq_group("again", list(range(1, 10)))
    bm.allocate(again)
    assert bm.get_num_computed_tokens(again.seqs[0]) == 0
    bm.check_invariants()


def test_a_hit_starts_from_the_snapshot_saved_at_its_last_block() -> None:
    bm = _manager(4)
    first = _admit(bm, "first")  # 9 tokens: two full blocks of 4
    seq = first.seqs[0]
    assert bm.state_chunk(seq, 9) == 8  # the prefill stops at the prompt's last boundary
    save = bm.save_state(seq, 8)
    assert save is not None and save[0] == bm.state_slot(seq.seq_id)
    seq.num_computed_tokens = 8
    bm.mark_computed(seq)  # the step that wrote the snapshot is done
    bm.check_invariants()
    bm.now += 1
    again = make_seq_group("again", list(range(1, 10)))
    bm.allocate(again)
    other = again.seqs[0]
    other.num_computed_tokens = bm.get_num_computed_tokens(other)
    assert other.num_computed_tokens == 8
    assert bm.pop_state_source(other) == save[1]
    bm.check_invariants()
    assert bm.states is not None and bm.states.num_snapshots() == 1
    bm.free(seq)
    bm.free(other)
    # The snapshot stays cached, and counts as free (the next step may evict it).
    assert bm.states.num_unheld() == bm.states.num_slots


def test_decoded_blocks_keep_snapshots_in_free_slots_only() -> None:
    """A decode that ends on a block boundary keeps the state there (a later turn's prompt, or
    a move, starts from it), but only into a free slot: it never evicts a prompt's snapshot."""
    bm = _manager(3)
    group = make_seq_group("a", [1, 2, 3])  # 3 tokens: the boundary at 4 is a decoded one
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 3
    seq.append_token_id(7, {7: 0.0})
    assert bm.save_state(seq, 1) is not None  # slots 1 and 2 were free
    seq.num_computed_tokens = 4
    bm.mark_computed(seq)
    states = bm.states
    assert states is not None and states.num_snapshots() == 1
    bm.check_invariants()
    # A prompt snapshot takes the last free slot; then a decode finds none and evicts none.
    assert states.save(12345) is not None
    bm.now += 1
    states.now = bm.now
    assert states.save(777, evict=False) is None and states.num_snapshots() == 2
    assert states.save(778) is not None  # a prompt's snapshot may evict the LRU one


def test_a_transfer_carries_the_deepest_snapshot_and_holds_it_on_both_sides() -> None:
    source, target = _manager(2), _manager(2)
    assert source.states is not None and target.states is not None
    key = state_key(6)  # the snapshot after the block hashed 6
    slot = source.states.save(key)
    assert slot is not None
    source.states.mark_saved(key)
    assert source.transfers.snapshot_key([5, 6, 7], 3) == key  # none after block 7
    assert source.transfers.snapshot_key([5, 6, 7], 1) is None  # past the blocks moved
    # The export pins it: a request needing every slot cannot evict it.
    assert source.transfers.pin(1, [], state_key(5)) is None  # none saved there
    assert source.transfers.pin(2, [], key) == slot
    source.now += 1
    source.states.now = source.now
    assert source.states.num_free() == 1
    blocks, received = target.transfers.allocate_pinned(3, [], key)
    assert blocks == [] and received is not None
    assert not target.states.is_saved(key) and target.states.num_free() == 1
    target.transfers.mark_imported(3)
    target.transfers.unpin(3)
    assert target.states.is_saved(key)  # a hit may read it now, and it is evictable
    target.now += 1
    target.states.now = target.now
    assert target.states.num_free() == 2
    # An import that never arrived leaves nothing behind.
    assert target.transfers.allocate_pinned(4, [], state_key(8))[1] is not None
    target.transfers.unpin(4)
    assert not target.states.is_saved(state_key(8)) and target.states.num_snapshots() == 1
    source.transfers.unpin(2)
    source.transfers.unpin(1)
    assert source.states.num_free() == 2
    source.check_invariants()
    target.check_invariants()
