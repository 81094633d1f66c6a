from __future__ import annotations

from scheduler_service.engine import (
    AllocStatus,
    BlockSpaceManager,
    LRUEvictor,
    Sequence,
    SequenceStatus,
)

from .factories import decode, make_seq_group


def test_allocate_gives_lowest_free_blocks_covering_the_prompt():
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, enable_caching=False)
    g = make_seq_group("a", list(range(10)))
    bm.allocate(g)
    assert bm.get_block_table(g.seqs[0]) == [0, 1, 2]
    assert bm.get_num_free_gpu_blocks() == 5
    bm.check_invariants()


def test_watermark_never_vs_later():
    bm = BlockSpaceManager(4, 10, 4, watermark=0.2, enable_caching=False)  # 2 blocks kept
    assert bm.can_allocate(make_seq_group("x", list(range(36)))) is AllocStatus.NEVER  # 9 blocks
    assert bm.can_allocate(make_seq_group("y", list(range(32)))) is AllocStatus.OK  # 8 blocks
    bm.allocate(make_seq_group("z", [1, 2, 3, 4]))
    later = make_seq_group("w", list(range(32)))
    assert bm.can_allocate(later) is AllocStatus.LATER  # 9 free - 8 < 2
    assert bm.can_allocate(make_seq_group("v", list(range(28)))) is AllocStatus.OK


def _computed_parent_and_fork() -> tuple[BlockSpaceManager, Sequence, Sequence]:
    """A 6-token prompt (blocks 0 and 1 of 8, block size 4) fully computed, then forked:
    parent and child share both blocks."""
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, enable_caching=False)
    g = make_seq_group("a", [1, 2, 3, 4, 5, 6])
    parent = g.seqs[0]
    bm.allocate(g)
    parent.status = SequenceStatus.RUNNING
    parent.num_computed_tokens = 6
    child = parent.fork(77, 1)
    bm.fork(parent, child)
    g.add(child)
    return bm, parent, child


def test_copy_on_write_of_shared_last_block():
    bm, parent, child = _computed_parent_and_fork()
    assert bm.get_block_table(child) == [0, 1]
    parent.append_token_id(9, {9: -1.0})
    child.append_token_id(8, {8: -1.0})
    # The parent writes slot 6 in shared block 1: it gets a copy (block 2); the child then
    # owns block 1 alone and writes in place.
    assert bm.append_slots(parent) == [(1, 2)]
    assert bm.append_slots(child) == []
    assert bm.get_block_table(parent) == [0, 2]
    assert bm.get_block_table(child) == [0, 1]
    assert bm.pop_dirty_from(parent.seq_id) == 1
    assert bm.pop_dirty_from(child.seq_id) is None
    bm.check_invariants()


def test_append_slots_adds_copies_to_the_callers_list():
    bm, parent, child = _computed_parent_and_fork()
    parent.append_token_id(9, {9: -1.0})
    assert not bm.has_dirty_tables()
    copies = [(5, 6)]
    assert bm.append_slots(parent, copies) is copies
    assert copies == [(5, 6), (1, 2)]
    assert bm.has_dirty_tables()
    assert bm.pop_dirty_from(parent.seq_id) == 1
    assert not bm.has_dirty_tables()


def test_swap_out_and_in_map_shared_blocks_once():
    bm = BlockSpaceManager(4, 8, 8, watermark=0.0, enable_caching=False)
    g = make_seq_group("a", [1, 2, 3, 4, 5, 6])
    bm.allocate(g)
    parent = g.seqs[0]
    parent.status = SequenceStatus.RUNNING
    child = parent.fork(77, 1)
    bm.fork(parent, child)
    g.add(child)
    decode(bm, g, 5)  # parent copies block 1 to 2; child keeps 1
    assert bm.can_swap_out(g)
    mapping = bm.swap_out(g)
    assert mapping == {0: 0, 2: 1, 1: 2}  # block 0 shared: copied once
    assert bm.get_block_table(parent) == [0, 1]
    assert bm.get_block_table(child) == [0, 2]
    assert bm.cpu.ref_counts[0] == 2
    assert bm.get_num_free_gpu_blocks() == 8
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    bm.check_invariants()
    assert bm.can_swap_in(g)
    # The free queue is FIFO: blocks 3..7 were never used, 0..2 were freed by the swap-out.
    assert bm.swap_in(g) == {0: 3, 1: 4, 2: 5}
    assert bm.get_block_table(parent) == [3, 4]
    assert bm.get_block_table(child) == [3, 5]
    assert bm.gpu.ref_counts[3] == 2
    assert bm.pop_dirty_from(parent.seq_id) == 0
    assert bm.get_num_free_cpu_blocks() == 8
    bm.check_invariants()


def test_prefix_cache_hit_reuses_blocks_after_the_owner_finished():
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, enable_caching=True)
    owner = make_seq_group("a", list(range(10)))
    bm.allocate(owner)
    seq = owner.seqs[0]
    assert bm.get_num_computed_tokens(seq) == 0
    seq.num_computed_tokens = 10
    bm.mark_computed(seq)
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8
    reuser = make_seq_group("b", list(range(8)) + [50, 51, 52])
    bm.allocate(reuser)
    # Blocks 0 and 1 (tokens 0..7) come back from the cache; the tail is a fresh block 3.
    assert bm.get_block_table(reuser.seqs[0]) == [0, 1, 3]
    assert bm.get_num_computed_tokens(reuser.seqs[0]) == 8
    assert (bm.prefix.queries, bm.prefix.hits) == (4, 2)
    # Same tokens at a different position do not hit: hashes chain through the parent.
    shifted = make_seq_group("c", [99, 0, 1, 2, 3, 4, 5, 6, 7])
    bm.allocate(shifted)
    assert bm.get_num_computed_tokens(shifted.seqs[0]) == 0
    bm.check_invariants()


def test_full_prompt_hit_leaves_last_token_to_compute():
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, enable_caching=True)
    g = make_seq_group("a", list(range(8)))
    bm.allocate(g)
    g.seqs[0].num_computed_tokens = 8
    bm.mark_computed(g.seqs[0])
    h = make_seq_group("b", list(range(8)))
    bm.allocate(h)
    assert bm.get_block_table(h.seqs[0]) == [0, 1]
    assert bm.get_num_computed_tokens(h.seqs[0]) == 7


def test_uncomputed_cached_blocks_do_not_count_as_hits():
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, enable_caching=True)
    bm.allocate(make_seq_group("a", list(range(8))))
    h = make_seq_group("b", list(range(8)) + [1])
    bm.allocate(h)
    assert bm.get_block_table(h.seqs[0]) == [0, 1, 2]
    assert bm.get_num_computed_tokens(h.seqs[0]) == 0


def test_evictor_lru_then_most_hashed_tokens():
    ev = LRUEvictor()
    ev.add(5, 1.0, 4)
    ev.add(6, 1.0, 12)
    ev.add(7, 1.0, 8)
    ev.add(3, 0.5, 4)
    ev.add(9, 2.0, 16)
    ev.remove(7)
    assert [ev.evict() for _ in range(4)] == [3, 6, 5, 9]
    assert len(ev) == 0


def test_eviction_order_in_the_block_manager():
    bm = BlockSpaceManager(4, 6, 4, watermark=0.0, enable_caching=True)
    old = make_seq_group("old", list(range(8)))  # blocks 0, 1
    bm.allocate(old)
    bm.now = 1.0
    bm.free(old.seqs[0])
    new = make_seq_group("new", list(range(100, 112)))  # blocks 2, 3, 4
    bm.allocate(new)
    bm.now = 2.0
    bm.free(new.seqs[0])
    # Free queue: block 5 only; then evict LRU first (old: deepest block 1, then 0), then
    # the newer prefix from its tail (4, 3, 2).
    g = make_seq_group("big", list(range(200, 224)))
    bm.allocate(g)
    assert bm.get_block_table(g.seqs[0]) == [5, 1, 0, 4, 3, 2]
    bm.check_invariants()
